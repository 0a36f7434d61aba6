"""The chunked SSD algorithm of Mamba-2 (Dao & Gu, 2024, Section 6, Listing 1 "ssd_minimal"): exact,
any T. `scalar_gla_chunk` is the algorithm with the decay g and the input v given apart, i.e. linear
attention with one log-decay per head and token,

    h_t = exp(g_t) h_{t-1} + v_t k_t^T,    y_t = h_t q_t          h_t ∈ R^{P × N} per head

which SSD forms from one Δ (g = Δ A with A constant per head, v = Δ x, q = C, k = B) and Mamba-3's
trapezoid (kernels/mamba3/trapezoid.py) from A_t per token and its input weight. With chunks of L
tokens and cum_t = Σ_{r <= t in the chunk} g_r:

    1. intra-chunk (quadratic, the parallel form per chunk):  Y_diag = (L_c ∘ Q K^T) V,  L_c[t, s] = exp(cum_t - cum_s)
    2. chunk states from a zero state:   S_c = Σ_s L_c[L-1, s] v_s k_s^T
    3. state passing across chunks:      h_in(c+1) = exp(cum_{L-1}) h_in(c) + S_c
    4. state -> output:                  Y_off = exp(cum_t) q_t h_in(c)
    SSD: y = Y_diag + Y_off + D x

Departures from the paper's listing: L_c uses exp(cum_t - cum_s), as the official Triton kernels do,
rather than the listing's stable segsum (see the comment in the code); step 3 is a lax.scan over
chunks (linear in T / L, like the official `_state_passing` kernel) instead of the listing's
quadratic segsum over chunks; B and C are repeated from G groups to H heads once at the start.
Document starts are masked, never approximated: L_c is exactly 0 across documents
(parallel.decay_mask), and the carried state and the chunk decay are zeroed from the first start
inside a chunk on. Padding to a multiple of L uses g = 0 and v = 0 (SSD: Δ = 0, decay 1, input 0),
so padded steps leave the state unchanged.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.decayed_chunks import carry_states, split_chunks
from kernels.ssd.cpu import ssd_chunk_cpu
from kernels.ssd.parallel import decay_mask
from kernels.ssd.reference import heads_from_groups


def scalar_gla_chunk(q: Float[Array, "B T H N"], k: Float[Array, "B T H N"], v: Float[Array, "B T H P"],
                     g: Float[Array, "B T H"], starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"],
                     chunk_size: int):
    """float32 in; returns y (B, T, H, P) and the final state (B, H, P, N)."""
    Bsz, T, H, P = v.shape
    L = min(chunk_size, T)  # a short call pads no further than T
    q, k, v, g, starts = (split_chunks(a, L) for a in (q, k, v, g, starts))  # (B, nC, L, ...)
    doc = jnp.cumsum(starts, axis=2)  # (B, nC, L) document index inside the chunk, 0 = carried one

    # Log-decay from s to t inside the chunk as a difference of cumulative sums, like the official
    # Triton kernels: it loses eps * |Σ_chunk g| of precision, bounded by the chunk length, and avoids
    # the O(L^3) stable segsum of parallel.py. The sum runs across document starts; an earlier
    # document's decays cancel out of every kept entry, up to that same rounding.
    cum = jnp.cumsum(jnp.moveaxis(g, 3, 1), axis=-1)  # (B, H, nC, L)
    Lmat = decay_mask(cum[..., :, None] - cum[..., None, :], doc)  # (B, H, nC, L, L)
    # Contractions spelled out pairwise: a 4-operand einsum let XLA materialise (B, nC, L, L, H, N).
    scores = jnp.einsum("bclhn,bcshn->bhcls", q, k) * Lmat  # (B, H, nC, L, L)
    y_diag = jnp.einsum("bhcls,bcshp->bclhp", scores, v)
    states = jnp.einsum("bcshn,bcshp->bchpn", k, v * jnp.moveaxis(Lmat[..., -1, :], 1, 3)[..., None])

    # Decay from the chunk start to t, exactly 0 from the first document start in the chunk on.
    from_start = jnp.where((doc == 0)[:, None], jnp.exp(cum), 0.0)  # (B, H, nC, L)
    chunk_decay = jnp.moveaxis(from_start[..., -1], 2, 1)[..., None, None]  # (B, nC, H, 1, 1)
    h_in, h_final = carry_states(chunk_decay, states, h0, axis=1)  # (B, nC, H, P, N): entering each chunk
    y_off = jnp.einsum("bclhn,bchpn->bclhp", q * jnp.moveaxis(from_start, 1, 3)[..., None], h_in)
    return (y_diag + y_off).reshape(Bsz, -1, H, P)[:, :T], h_final


def ssd_chunk(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
              B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], D: Float[Array, " H"] | None,
              starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"], chunk_size: int, cpu_kernels: bool = False):
    """cpu_kernels: the algorithm through cpu.py's kernels (each head reads its group in place)."""
    H = x.shape[2]
    if cpu_kernels:
        y, h = ssd_chunk_cpu(C, B, x * dt[..., None], dt * A, starts, h0, chunk_size)
    else:
        B, C = heads_from_groups(B, H), heads_from_groups(C, H)  # (B, T, H, N)
        y, h = scalar_gla_chunk(C, B, x * dt[..., None], dt * A, starts, h0, chunk_size)
    return (y if D is None else y + D[:, None] * x), h
