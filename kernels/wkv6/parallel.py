"""WKV6 in its masked quadratic ("parallel") form: the whole sequence at once, no scan.

    o_t = (r_t * e^{G_{t-1}})^T S_0 + sum_{s<t} [sum_k r_tk k_sk e^{G_{t-1,k} - G_{s,k}}] v_s + (r_t * u * k_t)^T 1 v_t

with G_t = sum_{i<=t} log w_i over the sequence. The per-channel decay makes the (T, T) score matrix
a contraction over K of a decayed (T, T, K) product rather than one matmul, so it is built exactly
as the chunk form builds a chunk's scores (kernels/decayed_chunks.py's decayed_scores: pairwise inside 16-token
sub-chunks, split at sub-chunk edges across them, every exponent a sum of log decays <= 0): this is
the chunk form with one chunk spanning the sequence. Memory O(T (16 + T / 16) K) per head.
"""

from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import SUB
from kernels.wkv6.chunk import wkv6_chunk


def wkv6_parallel(r: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                  log_w: Float[Array, "B T H K"], u: Float[Array, "H K"], *,
                  segment_ids: Int[Array, "B T"] | None = None,
                  initial_state: Float[Array, "B H K V"] | None = None):
    """Returns (o (B, T, H, V) in r's dtype, S_T (B, H, K, V) float32)."""
    length = SUB * -(-r.shape[1] // SUB)  # one chunk, padded to whole sub-chunks
    return wkv6_chunk(r, k, v, log_w, u, segment_ids=segment_ids, initial_state=initial_state, chunk_size=length)
