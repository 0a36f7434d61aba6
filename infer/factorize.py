"""Low-rank copies of a model (layers/factor.py on each projection): every weight read through `project`
(the ones infer/prune.py prunes) replaced by two factors of rank round(rank_fraction x min(In, Out)), from
the plain truncated SVD or, given calibration token ids, the activation-aware one (SVD-LLM's whitening by
the Hessian of the projection's inputs, from one forward pass of the float model).

    small = infer.factorize(model, 0.5, calibration=tokens)   # model itself is untouched

A factored projection multiplies by r (In + Out) numbers instead of In Out, so it is smaller and faster
below r = In Out / (In + Out) (half of min(In, Out) for a square weight). The copy decodes and runs forward
passes; it is not for the training loop (a config cannot describe it) and its factors carry no sharding
axes (one device).
"""

import math

import jax.numpy as jnp
from flax import nnx

from infer.quantize import input_hessians, is_projection, matrices
from layers.factor import Factored
from layers.factor import factorize as factorize_weight
from zoo.model import LanguageModel


def factorize(model: LanguageModel, rank_fraction: float = 0.5, *, calibration=None) -> LanguageModel:
    """A copy of `model` with each projection W (In, Out) held as A (In, r) B (r, Out), r =
    max(1, round(rank_fraction x min(In, Out))): plain SVD, or whitened by `calibration`'s input Hessians."""
    if isinstance(rank_fraction, bool) or not 0 < rank_fraction <= 1:
        raise ValueError(f"factorize: rank_fraction={rank_fraction!r}; expected a fraction in (0, 1]")
    model = nnx.clone(model)
    todo = [t for t in matrices(model) if is_projection(model, t)]
    hessians = {} if calibration is None else input_hessians(model, todo, calibration, who="factorize")
    for i, (m, name, in_ndim, *_) in enumerate(todo):
        w = getattr(m, name).get_value()
        In = math.prod(w.shape[:in_ndim])
        w2 = w.reshape(In, -1)
        rank = max(1, round(rank_fraction * min(w2.shape)))
        h = hessians.get(i)
        a, b = factorize_weight(w2, rank, None if h is None else jnp.asarray(h))
        setattr(m, name, nnx.Param(Factored(a, b, tuple(w.shape), in_ndim)))
    return model
