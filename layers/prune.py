"""Weight pruning of one projection y = x W, W (In, Out), to a sparsity or an n:m pattern: by magnitude,
by Wanda (Sun et al., 2024: |W_ij| times the norm of input i over the calibration set), or by SparseGPT
(Frantar & Alistarh, 2023: the same row-by-row optimal update as GPTQ, layers/gptq.py, with pruning in
place of rounding, so the kept weights absorb the pruned ones' error on the calibration inputs).

The choice is made per output column (a row of W in PyTorch's (Out, In) layout, as Wanda compares):
`sparsity` s prunes round(s x In) inputs of each column (s x block of each block of rows for SparseGPT,
whose mask is chosen a block at a time from the weights as they stand, with saliency w^2 / U_ii^2);
`n_of_m` (n, m) prunes n of every m consecutive inputs of each column (2:4 is (2, 4), the pattern sparse
tensor cores read along the contraction axis). Departures: SparseGPT's reference picks each block's
mask over the block as a whole, not per column; ours keeps every column at the asked sparsity.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from layers.gptq import inverse_factor, prepare

METHODS = ("magnitude", "wanda", "sparsegpt")


def _lowest(saliency: Float[Array, "R Out"], k: int) -> Bool[Array, "R Out"]:
    """True at the k lowest entries of each column (ties to the lower row)."""
    rank = jnp.argsort(jnp.argsort(saliency, axis=0, stable=True), axis=0, stable=True)
    return rank < k


def _mask(saliency: Float[Array, "R Out"], sparsity: float | None, n_of_m: tuple[int, int] | None
          ) -> Bool[Array, "R Out"]:
    """True where pruned: round(sparsity x R) per column, or n of every m consecutive rows per column."""
    R, Out = saliency.shape
    if n_of_m is None:
        return _lowest(saliency, round(sparsity * R))
    n, m = n_of_m
    return jax.vmap(lambda s: _lowest(s, n))(saliency.reshape(R // m, m, Out)).reshape(R, Out)


def _check(method, In, sparsity, n_of_m, block):
    if method not in METHODS:
        raise ValueError(f"prune: method={method!r}; expected one of {METHODS}")
    if (sparsity is None) == (n_of_m is None):
        raise ValueError(f"prune: give sparsity or n_of_m, not {'both' if sparsity is not None else 'neither'}")
    if sparsity is not None and not 0 <= sparsity < 1:
        raise ValueError(f"prune: sparsity={sparsity}; expected a fraction in [0, 1)")
    if n_of_m is not None:
        n, m = n_of_m
        if not 0 < n < m or In % m:
            raise ValueError(f"prune: n_of_m={tuple(n_of_m)}; expected 0 < n < m with m dividing the input width {In}")
    if method == "sparsegpt" and n_of_m is not None and block % n_of_m[1]:
        raise ValueError(f"prune: block={block} must be a multiple of m={n_of_m[1]}")


@functools.partial(jax.jit, static_argnames=("method", "sparsity", "n_of_m", "block"))
def prune_weight(w: Float[Array, "In Out"], h: Float[Array, "In In"] | None = None, method: str = "sparsegpt", *,
                 sparsity: float | None = 0.5, n_of_m: tuple[int, int] | None = None, block: int = 128,
                 damp: float = 0.01) -> Float[Array, "In Out"]:
    """w with the chosen entries zeroed (and, for SparseGPT, the kept ones updated), in w's dtype. `h` is
    X^T X of the calibration inputs (layers/gptq.hessian); magnitude pruning does not read it."""
    In, Out = w.shape
    _check(method, In, sparsity, n_of_m, block)
    if method != "magnitude" and (h is None or h.shape != (In, In)):
        raise ValueError(f"prune: {method} needs the inputs' Hessian ({In}, {In}); got "
                         f"{None if h is None else h.shape}")
    if method == "magnitude":
        return jnp.where(_mask(jnp.abs(w.astype(jnp.float32)), sparsity, n_of_m), 0, w)
    if method == "wanda":
        norm = jnp.sqrt(jnp.maximum(jnp.diag(h.astype(jnp.float32)), 0))
        return jnp.where(_mask(jnp.abs(w.astype(jnp.float32)) * norm[:, None], sparsity, n_of_m), 0, w)
    wf, hf = prepare(w, h, damp)
    u = inverse_factor(hf)
    B = min(block, In)
    if In % B:
        raise ValueError(f"prune: block={block} does not divide the input width {In}")

    def row(i, carry):
        wf, pruned = carry
        # a new block: its mask from its rows as they stand now (dynamic_slice keeps in bounds)
        rows = jax.lax.dynamic_slice_in_dim(wf, i, B)
        diag = jax.lax.dynamic_slice_in_dim(jnp.diag(u), i, B)
        fresh = _mask(rows ** 2 / diag[:, None] ** 2, sparsity, n_of_m)
        pruned = jnp.where(i % B == 0, jax.lax.dynamic_update_slice_in_dim(pruned, fresh, i, 0), pruned)
        q = jnp.where(pruned[i], 0.0, wf[i])
        err = (wf[i] - q) / u[i, i]
        wf = wf - jnp.where(jnp.arange(In)[:, None] > i, u[i][:, None] * err[None, :], 0.0)
        return wf.at[i].set(q), pruned

    wf, _ = jax.lax.fori_loop(0, In, row, (wf, jnp.zeros((In, Out), bool)))
    return wf.astype(w.dtype)
