"""Chunkwise-parallel causal linear attention (no decay), plain JAX.

Split time into chunks of C tokens. With S_[n] the state after chunk n (the chunkwise form of linear
attention as written in Yang et al., 2024, the GLA paper):

    O_[n]   = scale * ((Q_[n] K_[n]^T ⊙ M) V_[n] + Q_[n] S_[n-1])          M: causal mask
    S_[n]   = S_[n-1] + K_[n]^T V_[n]

The intra-chunk part is a (C, C) matmul per chunk, all chunks at once; only the (K, V) state is
carried through a `lax.scan` over chunks.

Documents (`segment_ids`): with doc(t) the running count of document starts, M also requires
doc(i) == doc(j); the carried state belongs to the document of the token before the chunk, so
Q_[n] S_[n-1] is kept only for tokens of that document, and S_[n] keeps S_[n-1] only if the chunk
holds no document start and sums only the keys of the chunk's last document.

Any T: the input is padded with zeros to a multiple of C; zero keys and values add nothing.
"""

from kernels.scalar_decay import scalar_decay_chunk


def linear_attention_chunk(q, k, v, **kwargs):
    """`linear_attention`'s arguments (kernels/linear_attention/__init__.py; shapes checked in
    scalar_decay_chunk) with chunk_size. Returns (o (B, T, H, V) in q's dtype, S float32)."""
    return scalar_decay_chunk(q, k, v, None, **kwargs)  # retention with gamma = 1, no decay factors
