"""Chunkwise-parallel retention (Sun et al., 2023, the "chunkwise recurrent representation"),
plain JAX.

With chunks of C tokens, b_i = sum of log(gamma) over the chunk's tokens up to and including i
(so b_i = (i + 1) log gamma inside a full chunk) and S_[n] the state after chunk n:

    O_[n] = scale * ((Q K^T ⊙ D) V + (Q ⊙ e^{b}) S_[n-1])        D_ij = [j <= i] e^{b_i - b_j}
    S_[n] = e^{b_{C-1}} S_[n-1] + (K ⊙ e^{b_{C-1} - b})^T V

Every exponent is <= 0, so nothing overflows (this is the paper's form with the decay written in
log space). The (K, V) state is carried through a `lax.scan` over chunks.

Documents (`segment_ids`): with doc(t) the running count of document starts, D also requires
doc(i) == doc(j); the carried state is seen only by tokens of the document of the token before the
chunk, kept only if the chunk holds no document start, and the update sums only the keys of the
chunk's last document. Decay across a boundary is never used, so resets are exact.

Any T: padding tokens get zero q, k, v and log-decay 0 (gamma = 1), so they neither add to nor decay
the state.
"""

from jaxtyping import Array, Float

from kernels.scalar_decay import scalar_decay_chunk


def retention_chunk(q, k, v, log_gamma: Float[Array, " H"], **kwargs):
    """`retention`'s arguments (kernels/retention/__init__.py; shapes checked in scalar_decay_chunk)
    with log_gamma = log(gamma) and chunk_size. Returns (o (B, T, H, V) in q's dtype, S float32)."""
    return scalar_decay_chunk(q, k, v, log_gamma, **kwargs)
