"""Low-rank copies of a model (layers/factor.py on each projection): every weight read through `project`
(the ones infer/prune.py prunes) replaced by two factors of rank round(rank_fraction x min(In, Out)), from
the plain truncated SVD or, given calibration token ids, the activation-aware one (SVD-LLM's whitening by
the Hessian of the projection's inputs, from one forward pass of the float model). With
allocate="spectrum", the same parameters are spread over the projections by their singular values: the
ones whose spectra fall slowly get more rank (SVD-LLM v2's point), chosen greedily by the share of each
projection's own energy (sigma^2 over its sum; with whitening, of its output) a rank keeps per parameter.
Each projection's own share, not its absolute error: absolute errors send every rank to the projections
with the largest inputs and leave the rest at rank 1.

    small = infer.factorize(model, 0.5, calibration=tokens)   # model itself is untouched
    spread = infer.factorize(model, 0.5, calibration=tokens, allocate="spectrum")

A factored projection multiplies by r (In + Out) numbers instead of In Out, so it is smaller and faster
below r = In Out / (In + Out) (half of min(In, Out) for a square weight). The copy decodes and runs forward
passes; it is not for the training loop (a config cannot describe it) and its factors carry no sharding
axes (one device).
"""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.quantize import input_hessians, is_projection, matrices
from layers.factor import Factored, spectrum, truncate
from zoo.model import LanguageModel

ALLOCATIONS = ("uniform", "spectrum")


def factorize(model: LanguageModel, rank_fraction: float = 0.5, *, calibration=None,
              allocate: str = "uniform") -> LanguageModel:
    """A copy of `model` with each projection W (In, Out) held as A (In, r) B (r, Out): plain SVD, or
    whitened by `calibration`'s input Hessians. allocate="uniform": r = max(1, round(rank_fraction x
    min(In, Out))) everywhere; "spectrum": at most as many parameters in all, each projection's rank from
    the normalised singular values of every projection (rank_allocation)."""
    if isinstance(rank_fraction, bool) or not 0 < rank_fraction <= 1:
        raise ValueError(f"factorize: rank_fraction={rank_fraction!r}; expected a fraction in (0, 1]")
    if allocate not in ALLOCATIONS:
        raise ValueError(f"factorize: allocate={allocate!r}; expected one of {ALLOCATIONS}")
    model = nnx.clone(model)
    found = spectra(model, calibration)
    shapes = [svd[0].shape[:1] + svd[2].shape[1:] for *_, svd in found]  # (In, Out) of each projection
    ranks = [max(1, round(rank_fraction * min(shape))) for shape in shapes]
    if allocate == "spectrum":
        budget = sum(r * sum(shape) for r, shape in zip(ranks, shapes))
        relative = [np.asarray(svd[1]) / np.linalg.norm(svd[1]) for *_, svd in found]  # each one's energy shares
        ranks = rank_allocation(relative, [sum(shape) for shape in shapes], budget)
    for (m, name, in_ndim, w, svd), rank in zip(found, ranks):
        a, b = truncate(svd, rank, w.dtype)
        setattr(m, name, nnx.Param(Factored(a, b, tuple(w.shape), in_ndim)))
    return model


def spectra(model: LanguageModel, calibration=None) -> list[tuple]:
    """(module, parameter name, in_ndim, weight, layers.factor.spectrum of its (In, Out) matrix) of each
    projection of `model`, the spectrum whitened by `calibration`'s input Hessian when given."""
    todo = [t for t in matrices(model) if is_projection(model, t)]
    hessians = {} if calibration is None else input_hessians(model, todo, calibration, who="factorize")
    found = []
    for i, (m, name, in_ndim, *_) in enumerate(todo):
        w = getattr(m, name).get_value()
        h = hessians.get(i)
        found.append((m, name, in_ndim, w, spectrum(w.reshape(math.prod(w.shape[:in_ndim]), -1),
                                                     None if h is None else jnp.asarray(h))))
    return found


def rank_allocation(spectra: list, costs: list[int], budget: int) -> list[int]:
    """Ranks that discard the least squared singular value within `budget` parameters, a rank of
    projection p costing costs[p] = In + Out: every projection keeps rank 1, then each next singular
    value, over all projections, in order of sigma^2 / cost while it fits (a projection's values fall,
    so its ranks are taken in order)."""
    ranks, left = [1] * len(spectra), budget - sum(costs)
    gains = sorted((-float(s[r]) ** 2 / costs[p], p, r) for p, s in enumerate(spectra) for r in range(1, len(s)))
    for _, p, r in gains:
        if ranks[p] == r and costs[p] <= left:
            ranks[p], left = r + 1, left - costs[p]
    return ranks
