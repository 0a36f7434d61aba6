"""DeltaFormer's values in parallel form (kernels/deltaformer/reference.py for the equations): every row's
weights at once, then u from a unit lower-triangular system.

    A   = masked row softmax of W K^T * scale over the keys each token sees     (T, T), strictly lower
    (I + diag(β) A) u = v - diag(β) A_c u_c                                      A_c, u_c: a KV cache's part

One masked softmax gives the rows of A (and A_c, over the same denominator, when a cache comes first). The
system is solved by forward substitution over blocks of C = chunk_size rows: block b subtracts what the
solved blocks before it give, v_b - diag(β_b) A[b, :b] u[:b], then multiplies by the inverse of its own
unit lower-triangular C x C block, kernels/linalg.unit_lower_inverse (matmuls only: XLA:CPU's triangular
solve can deadlock, see there); the blocks' own inverses are taken all at once before the substitution, which
is a lax.scan over the blocks (one trace whatever T). Memory is O(B G T S), a dense attention's (and the scan's
gradient keeps u per block, O(B G T^2 V / C)); everything accumulates in float32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.linalg import unit_lower_inverse


def masked_softmax(z: Float[Array, "... S"], seen: Bool[Array, "... S"]) -> Float[Array, "... S"]:
    """Softmax of z over the entries `seen`, 0 elsewhere; a row that sees nothing is all 0 (no NaN)."""
    z = jnp.where(seen, z, -jnp.inf)
    top = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.where(seen, jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def solve_unit_lower(bA: Float[Array, "... T T"], rhs: Float[Array, "... T V"], chunk_size: int):
    """u with (I + bA) u = rhs, bA strictly lower-triangular: forward substitution over blocks of rows (T padded
    to whole blocks; the padding rows are zero and solve to zero)."""
    T, C = rhs.shape[-2], chunk_size
    if T <= C:
        return unit_lower_inverse(-bA) @ rhs
    n = -(-T // C)
    pad = [(0, 0)] * (rhs.ndim - 2)
    bA = jnp.pad(bA, (*pad, (0, n * C - T), (0, n * C - T)))
    rhs = jnp.pad(rhs, (*pad, (0, n * C - T), (0, 0)))
    rows = jnp.moveaxis(bA.reshape(*bA.shape[:-2], n, C, n * C), -3, 0)  # (n, ..., C, nC): each block's rows
    diag = jnp.stack([rows[b, ..., b * C:(b + 1) * C] for b in range(n)])  # (n, ..., C, C)
    inverses = unit_lower_inverse(-diag)  # every block's own inverse at once, before the substitution
    blocks = jnp.moveaxis(rhs.reshape(*rhs.shape[:-2], n, C, rhs.shape[-1]), -3, 0)  # (n, ..., C, V)

    def block(u, xs):  # u (..., nC, V): the rows solved so far, zero below them
        b, row, inv, r = xs
        u_b = inv @ (r - row @ u)  # row @ u: what the solved blocks give (unsolved rows are still zero)
        return jax.lax.dynamic_update_slice_in_dim(u, u_b, b * C, axis=-2), None

    u, _ = jax.lax.scan(block, jnp.zeros_like(rhs), (jnp.arange(n), rows, inverses, blocks))
    return u[..., :T, :]


def deltaformer_values_parallel(w: Float[Array, "B T G K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                                beta: Float[Array, "B T G"], seen: Bool[Array, "B T _"], scale: float,
                                chunk_size: int, cache_k: Float[Array, "B G S K"] | None = None,
                                cache_u: Float[Array, "B G S V"] | None = None) -> Float[Array, "B T G V"]:
    """u (B, T, G, V) float32; seen as reference.py's: [the cache's S slots | the call's T tokens]."""
    f32 = lambda a: a.astype(jnp.float32)
    w, k = f32(w), f32(k)
    z = jnp.einsum("btgk,bsgk->bgts", w, k) * scale  # (B, G, T, T)
    if cache_k is not None:
        z = jnp.concatenate([jnp.einsum("btgk,bgsk->bgts", w, f32(cache_k)) * scale, z], axis=-1)  # (B, G, T, S + T)
    a = masked_softmax(z, seen[:, None])
    S = a.shape[-1] - w.shape[1]
    b = f32(beta).transpose(0, 2, 1)[..., None]  # (B, G, T, 1)
    rhs = f32(v).transpose(0, 2, 1, 3)  # (B, G, T, V)
    if cache_k is not None:
        rhs = rhs - b * jnp.einsum("bgts,bgsv->bgtv", a[..., :S], f32(cache_u))
    u = solve_unit_lower(b * a[..., S:], rhs, chunk_size)  # (B, G, T, V)
    return u.transpose(0, 2, 1, 3)  # (B, T, G, V)
