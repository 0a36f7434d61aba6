"""WKV7 in its parallel form: the UT transform over the whole sequence at once, no scan.

The chunk form of chunk.py with a single chunk spanning the sequence (padded to whole 16-token
sub-chunks), as for the delta rule (Yang et al., 2024, sec. 3.1): with G_t = sum_{i<=t} log w_i over
the sequence,

    (I - A^ab) SA = (a * e^{G_-}) S_0 + A^ak V                          one T x T triangular solve
    O = (r * e^{G}) S_0 + A^rk V + A^rb SA

where A^xy_ts = sum_k x_tk y_sk e^{G_{t(-1),k} - G_{s,k}} are the decayed scores (strict for a,
inclusive for r), masked to one document. O is not (R K^T * M) V: the triangular solve is intrinsic
to the delta rule. Cost per head: T x T memory for the scores, O(T (16 + T / 16) K) for the decays,
O(T^2 (K + V)) work; it suits short sequences on wide hardware.
"""

from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import SUB
from kernels.wkv7.chunk import wkv7_chunk


def wkv7_parallel(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                  v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
                  segment_ids: Int[Array, "B T"] | None = None,
                  initial_state: Float[Array, "B H K V"] | None = None, max_decay: float | None = None):
    """Returns (o (B, T, H, V) in r's dtype, S_T (B, H, K, V) float32)."""
    length = SUB * -(-r.shape[1] // SUB)  # one chunk, padded to whole sub-chunks
    return wkv7_chunk(r, w_log, k, v, a, b, segment_ids=segment_ids, initial_state=initial_state,
                      chunk_size=length, max_decay=max_decay)
