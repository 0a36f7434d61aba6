"""SSD (Mamba-2) in its quadratic "attention" form over the whole sequence (Dao & Gu, 2024, eq. 16
and Section 4): y = (L ∘ C B^T)(Δ x) with the 1-semiseparable decay mask

    L[t, s] = exp(segsum(a)[t, s]) = Π_{s < r ≤ t} exp(Δ_r A_h)   for s ≤ t, else 0,
    y_t = Σ_{s ≤ t} L[t, s] (C_t · B_s) Δ_s x_s + L[t, -1] C_t h_0 + D x_t

O(T^2) work and memory per head: the form for short sequences, and the block the chunked
algorithm (chunk.py) applies inside each chunk. segsum here is the stable one of the paper's minimal
code, a masked cumulative sum of the log-decays: over a whole sequence a difference of two
cumulative sums would cost eps * |Σ_{r ≤ t} a_r| of relative precision even on the diagonal, which
grows with T (chunk.py uses the difference, where the chunk bounds it). XLA lowers that cumsum to a
reduce_window, so segsum costs O(T^3) adds: another reason this form is for short sequences.
Document starts mask L to exactly 0 between tokens of different documents, and the initial state
reaches only the first document.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.ssd.reference import heads_from_groups


def segsum(a: Float[Array, "... T"]) -> Float[Array, "... T T"]:
    """out[..., t, s] = Σ_{s < r ≤ t} a_r for s ≤ t (0 on the diagonal) and 0 for s > t (mask it)."""
    L = a.shape[-1]
    terms = jnp.where(jnp.tri(L, k=-1, dtype=bool), a[..., :, None], 0.0)  # [r, s] = a_r if r > s
    return jnp.cumsum(terms, axis=-2)


def decay_mask(seg: Float[Array, "B H ... T T"], doc: Int[Array, "B ... T"]) -> Float[Array, "B H ... T T"]:
    """L[t, s] = exp(seg[t, s]) of the docstring, exactly 0 above the diagonal and across documents.
    seg is masked before exp too: above the diagonal a difference of cumulative sums is positive and
    exp may overflow, and inf * 0 in the backward pass of `where` would be NaN."""
    L = seg.shape[-1]
    keep = ((doc[..., :, None] == doc[..., None, :]) & jnp.tri(L, dtype=bool))[:, None]  # (B, 1, ..., L, L)
    return jnp.where(keep, jnp.exp(jnp.where(keep, seg, 0.0)), 0.0)


def ssd_parallel(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
                 B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], D: Float[Array, " H"] | None,
                 starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"]):
    H = x.shape[2]
    B, C = heads_from_groups(B, H), heads_from_groups(C, H)  # (B, T, H, N)
    a = jnp.moveaxis(dt * A, 1, 2)  # (B, H, T) log-decays
    doc = jnp.cumsum(starts, axis=1)  # (B, T) document index, 0 for the one continuing h0
    xdt = x * dt[..., None]  # (B, T, H, P)
    Lmat = decay_mask(segsum(a), doc)  # (B, H, T, T)
    scores = jnp.einsum("bthn,bshn->bhts", C, B) * Lmat  # (B, H, T, T); pairwise, see chunk.py
    y = jnp.einsum("bhts,bshp->bthp", scores, xdt)
    # The initial state, decayed from the sequence start, reaches only document 0.
    from_start = jnp.where((doc == 0)[:, None], jnp.exp(jnp.cumsum(a, axis=-1)), 0.0)  # (B, H, T)
    y = y + jnp.einsum("bthn,bhpn->bthp", C * jnp.moveaxis(from_start, 1, 2)[..., None], h0)
    h = jnp.einsum("bshn,bshp->bhpn", B, xdt * jnp.moveaxis(Lmat[:, :, -1], 1, 2)[..., None])
    h = h + from_start[:, :, -1, None, None] * h0
    if D is not None:
        y = y + D[:, None] * x
    return y, h
