"""The chunked SSD algorithm of Mamba-2 (Dao & Gu, 2024, Section 6, Listing 1 "ssd_minimal"): exact,
any T. With chunks of L tokens and a_t = Δ_t A_h:

    1. intra-chunk (quadratic, the parallel form per chunk):  Y_diag = (L_c ∘ C B^T)(Δ x)
    2. chunk states from a zero state:   S_c = Σ_s L_c[L-1, s] Δ_s x_s B_s^T
    3. state passing across chunks:      h_in(c+1) = exp(Σ_{t in c} a_t) h_in(c) + S_c
    4. state -> output:                  Y_off = exp(Σ_{r ≤ t in c} a_r) C_t h_in(c)
    y = Y_diag + Y_off + D x

Departures from the paper's listing: L_c uses exp(cum_t - cum_s), as the official Triton kernels do,
rather than the listing's stable segsum (see the comment in the code); step 3 is a lax.scan over
chunks (linear in T / L, like the official `_state_passing` kernel) instead of the listing's
quadratic segsum over chunks; B and C are repeated from G groups to H heads once at the start.
Document starts are masked, never approximated: L_c is exactly 0 across documents
(parallel.decay_mask), and the carried state and the chunk decay are zeroed from the first start
inside a chunk on. Padding to a multiple of L uses
Δ = 0 (decay 1, input 0), so padded steps leave the state unchanged.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.ssd.parallel import decay_mask
from kernels.ssd.reference import heads_from_groups


def ssd_chunk(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
              B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], D: Float[Array, " H"] | None,
              starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"], chunk_size: int):
    Bsz, T, H, P = x.shape
    L = min(chunk_size, T)  # a short call pads no further than T
    nC = -(-T // L)

    def chunks(a):  # (B, T, ...) -> (B, nC, L, ...)
        a = jnp.pad(a, [(0, 0), (0, nC * L - T)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(Bsz, nC, L, *a.shape[2:])

    B, C = heads_from_groups(B, H), heads_from_groups(C, H)  # (B, T, H, N)
    x, dt, B, C, starts = map(chunks, (x, dt, B, C, starts))
    doc = jnp.cumsum(starts, axis=2)  # (B, nC, L) document index inside the chunk, 0 = carried one
    a = jnp.moveaxis(dt * A, 3, 1)  # (B, H, nC, L)
    xdt = x * dt[..., None]  # (B, nC, L, H, P)

    # Log-decay from s to t inside the chunk as a difference of cumulative sums, like the official
    # Triton kernels: it loses eps * |Σ_chunk a| of precision, bounded by the chunk length, and avoids
    # the O(L^3) stable segsum of parallel.py. The sum runs across document starts; an earlier
    # document's decays cancel out of every kept entry, up to that same rounding.
    cum = jnp.cumsum(a, axis=-1)  # (B, H, nC, L)
    Lmat = decay_mask(cum[..., :, None] - cum[..., None, :], doc)  # (B, H, nC, L, L)
    # Contractions spelled out pairwise: a 4-operand einsum let XLA materialise (B, nC, L, L, H, N).
    scores = jnp.einsum("bclhn,bcshn->bhcls", C, B) * Lmat  # (B, H, nC, L, L)
    y_diag = jnp.einsum("bhcls,bcshp->bclhp", scores, xdt)
    states = jnp.einsum("bcshn,bcshp->bchpn", B, xdt * jnp.moveaxis(Lmat[..., -1, :], 1, 3)[..., None])

    # Decay from the chunk start to t, exactly 0 from the first document start in the chunk on.
    from_start = jnp.where((doc == 0)[:, None], jnp.exp(cum), 0.0)  # (B, H, nC, L)

    def carry(h, inputs):  # state entering each chunk
        decay, state = inputs
        return decay[:, :, None, None] * h + state, h

    h_final, h_in = jax.lax.scan(carry, h0, (jnp.moveaxis(from_start[..., -1], 2, 0), jnp.moveaxis(states, 1, 0)))
    y_off = jnp.einsum("bclhn,cbhpn->bclhp", C * jnp.moveaxis(from_start, 1, 3)[..., None], h_in)
    y = (y_diag + y_off).reshape(Bsz, nC * L, H, P)[:, :T]
    if D is not None:
        y = y + D[:, None] * x.reshape(Bsz, nC * L, H, P)[:, :T]
    return y, h_final
