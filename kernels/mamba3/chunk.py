"""Linear attention with one log-decay per head and token, chunked (Dao & Gu, 2024, Section 6, the
chunked SSD algorithm): the core trapezoid.py runs Mamba-3's rewritten recurrence on,

    h_t = exp(g_t) h_{t-1} + v_t k_t^T,    y_t = h_t q_t          h_t ∈ R^{P × N} per head

It is kernels/ssd/chunk.py's algorithm with the decay g and the input v given apart: SSD forms both
from one Δ (g = Δ A with A constant per head, v = Δ x), Mamba-3 has A_t per token and the trapezoid's
input weight (SSD's forms could call this one with g = Δ A, v = Δ x). With chunks of L tokens and
cum_t = Σ_{r <= t in the chunk} g_r:

    1. intra-chunk (quadratic):      Y_diag = (L_c ∘ Q K^T) V,  L_c[t, s] = exp(cum_t - cum_s), s <= t
    2. chunk states from zero:       S_c = Σ_s L_c[L-1, s] v_s k_s^T
    3. state passing across chunks:  h_in(c+1) = exp(cum_{L-1}) h_in(c) + S_c   (a lax.scan)
    4. state -> output:              Y_off = exp(cum_t) q_t h_in(c)

Document starts are masked, never approximated, as in kernels/ssd/chunk.py: L_c is exactly 0 across
documents, and the carried state and the chunk decay are zeroed from the first start inside a chunk
on. Padding to a multiple of L uses g = 0 and v = 0, so padded steps leave the state unchanged.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.ssd.parallel import decay_mask


def scalar_gla_chunk(q: Float[Array, "B T H N"], k: Float[Array, "B T H N"], v: Float[Array, "B T H P"],
                     g: Float[Array, "B T H"], starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"],
                     chunk_size: int):
    """float32 in; returns y (B, T, H, P) and the final state (B, H, P, N)."""
    Bsz, T, H, P = v.shape
    L = min(chunk_size, T)  # a short call pads no further than T
    nC = -(-T // L)

    def chunks(a):  # (B, T, ...) -> (B, nC, L, ...)
        a = jnp.pad(a, [(0, 0), (0, nC * L - T)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(Bsz, nC, L, *a.shape[2:])

    q, k, v, g, starts = map(chunks, (q, k, v, g, starts))
    doc = jnp.cumsum(starts, axis=2)  # (B, nC, L) document index inside the chunk, 0 = carried one
    cum = jnp.cumsum(jnp.moveaxis(g, 3, 1), axis=-1)  # (B, H, nC, L); precision: see kernels/ssd/chunk.py
    Lmat = decay_mask(cum[..., :, None] - cum[..., None, :], doc)  # (B, H, nC, L, L)
    scores = jnp.einsum("bclhn,bcshn->bhcls", q, k) * Lmat  # (B, H, nC, L, L)
    y_diag = jnp.einsum("bhcls,bcshp->bclhp", scores, v)
    states = jnp.einsum("bcshn,bcshp->bchpn", k, v * jnp.moveaxis(Lmat[..., -1, :], 1, 3)[..., None])
    from_start = jnp.where((doc == 0)[:, None], jnp.exp(cum), 0.0)  # (B, H, nC, L)

    def carry(h, inputs):  # state entering each chunk
        decay, state = inputs
        return decay[:, :, None, None] * h + state, h

    h_final, h_in = jax.lax.scan(carry, h0, (jnp.moveaxis(from_start[..., -1], 2, 0), jnp.moveaxis(states, 1, 0)))
    y_off = jnp.einsum("bclhn,cbhpn->bclhp", q * jnp.moveaxis(from_start, 1, 3)[..., None], h_in)
    return (y_diag + y_off).reshape(Bsz, nC * L, H, P)[:, :T], h_final
