"""Log-linear Mamba-2 in its quadratic masked form (Guo et al., 2025, "Log-Linear Attention", Section 2,
eq. for O = (Q K^T ∘ M^H) V): Mamba-2's 1-semiseparable decay mask times the hierarchical one,

    M[t, s] = λ_t^(ℓ(t, s)) · exp(Σ_{s < r ≤ t} Δ_r A)   for s ≤ t in the same document, else 0,
    y_t = Σ_s M[t, s] (C_t · B_s) Δ_s x_s + Σ_j λ_t^(ℓ_0(t, j)) exp(Σ_{r ≤ t} Δ_r A) S_0^(j) C_t + D x_t

with ℓ(t, s) = bit_length(p_t XOR p_s) on the positions p inside the document (reference.py), capped at
L - 1, and ℓ_0(t, j) = max(j, bit_length(p_t XOR (n_0 - 1))) (capped) the level at which the initial
state's bucket j reaches query t, which only the first document of the call sees. O(T^2) work and
memory per head: the form for training on short sequences and for prefill. The decay is SSD's
(kernels/ssd/parallel.py: the stable segsum, masked before exp); the final state gathers every token
of the last document into the bucket of its level as seen from the last position.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.loglinear.reference import bit_length, fenwick_level
from kernels.ssd.parallel import decay_mask, segsum
from kernels.ssd.reference import heads_from_groups


def initial_levels(pos: Int[Array, "B T"], n0: Int[Array, " B"], L: int) -> Int[Array, "B T L"]:
    """ℓ_0: the level (capped at L - 1) at which bucket j of a state left after position n0 - 1 reaches
    the query at position pos, as the recurrence's merges move it."""
    seen = bit_length(jnp.bitwise_xor(pos, (n0 - 1)[:, None]))  # (B, T); 32 when n0 = 0
    return jnp.minimum(jnp.maximum(jnp.arange(L), seen[..., None]), L - 1)  # (B, T, L)


def loglinear_parallel(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
                       B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], lam: Float[Array, "B T H L"],
                       D: Float[Array, " H"] | None, doc: Int[Array, "B T"], pos: Int[Array, "B T"],
                       S0: Float[Array, "B H L P N"], n0: Int[Array, " B"]):
    """doc: the document index of each token (0 for the one continuing S0), pos: its position in its document
    (counting on from n0 in document 0). Returns y (B, T, H, P), the final states (B, H, L, P, N), count (B,)."""
    Bsz, T, H, _ = x.shape
    L = lam.shape[-1]
    B, C = heads_from_groups(B, H), heads_from_groups(C, H)  # (B, T, H, N)
    a = jnp.moveaxis(dt * A, 1, 2)  # (B, H, T) log-decays
    xdt = x * dt[..., None]  # (B, T, H, P)
    decay = decay_mask(segsum(a), doc)  # (B, H, T, T), 0 above the diagonal and across documents
    level = jnp.minimum(fenwick_level(pos[:, :, None], pos[:, None, :]), L - 1)  # (B, T, T)
    index = jnp.broadcast_to(level[:, None, :, :], (Bsz, H, T, T))  # (B, H, T, T)
    weight = jnp.take_along_axis(jnp.moveaxis(lam, 1, 2), index, axis=-1)  # (B, H, T, T): λ_t at ℓ(t, s)
    scores = jnp.einsum("bthn,bshn->bhts", C, B) * decay * weight  # (B, H, T, T)
    y = jnp.einsum("bhts,bshp->bthp", scores, xdt)
    # The initial state: bucket j, decayed from the call's start, weighted at its level ℓ_0(t, j).
    from_start = jnp.where((doc == 0)[:, :, None], jnp.exp(jnp.cumsum(dt * A, axis=1)), 0.0)  # (B, T, H)
    at = jnp.broadcast_to(initial_levels(pos, n0, L)[:, :, None], lam.shape)  # (B, T, H, L)
    w0 = jnp.take_along_axis(lam, at, axis=-1) * from_start[..., None]  # (B, T, H, L)
    y = y + jnp.einsum("bthl,bhlpn,bthn->bthp", w0, S0, C)
    if D is not None:
        y = y + D[:, None] * x
    # Final state: each token of the last document in its bucket as seen from the last position.
    last = pos[:, -1]  # (B,)
    bucket = jnp.minimum(fenwick_level(last[:, None], pos), L - 1)  # (B, T)
    onehot = (bucket[..., None] == jnp.arange(L)).astype(x.dtype)  # (B, T, L)
    to_end = jnp.moveaxis(decay[:, :, -1], 1, 2)  # (B, T, H): decay from s to the last token, 0 off its document
    S = jnp.einsum("bsl,bsh,bshp,bshn->bhlpn", onehot, to_end, xdt, B)
    moved = (initial_levels(last[:, None], n0, L)[:, 0, :, None] == jnp.arange(L)).astype(x.dtype)  # (B, j, L)
    S = S + jnp.einsum("bjl,bh,bhjpn->bhlpn", moved, from_start[:, -1], S0)
    return y, S, last + 1
