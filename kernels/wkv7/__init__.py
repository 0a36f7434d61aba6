"""WKV7, the generalised delta rule of RWKV-7 "Goose" (Peng et al., 2025, arXiv:2503.14456).

In our (K, V) state convention (the transpose of the paper's (V, K) one; see reference.py):

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T r_t

State (B, H, K, V) float32. The op takes w_log = log w_t <= 0; the model passes a = -kappa^,
b = kappa^ * a_icl.

Modes: "recurrent" (reference.py, a lax.scan), "chunk" (chunk.py, the WY/UT chunked form, exact for
any T) and "parallel" (parallel.py, the UT transform over the whole sequence: one T x T triangular
solve, no scan).
"""

from jaxtyping import Array, Float, Int

from kernels.wkv7.chunk import wkv7_chunk
from kernels.wkv7.parallel import wkv7_parallel
from kernels.wkv7.reference import wkv7_recurrent, wkv7_step

MODES = ("recurrent", "chunk", "parallel")
IMPLS = ("auto", "xla")


def wkv7(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
         v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
         segment_ids: Int[Array, "B T"] | None = None, initial_state: Float[Array, "B H K V"] | None = None,
         output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in r's dtype, final state (B, H, K, V) float32 or None)."""
    if mode not in MODES:
        raise ValueError(f"wkv7: unknown mode {mode!r}; modes: {MODES}")
    if impl not in IMPLS:
        raise ValueError(f"wkv7: unknown impl {impl!r}; impls: {IMPLS}")
    if chunk_size < 1:
        raise ValueError(f"wkv7: chunk_size must be >= 1, got {chunk_size}")
    B, T, H, K = r.shape
    if any(x.shape != r.shape for x in (w_log, k, a, b)) or v.shape[:3] != (B, T, H):
        raise ValueError(f"wkv7: shapes r{r.shape} w_log{w_log.shape} k{k.shape} v{v.shape} a{a.shape} "
                         f"b{b.shape} do not match r, w_log, k, a, b (B, T, H, K), v (B, T, H, V)")
    # The one dispatch point: only XLA forms exist so far, so "auto" and "xla" pick the same.
    if mode == "recurrent":
        o, state = wkv7_recurrent(r, w_log, k, v, a, b, segment_ids=segment_ids, initial_state=initial_state)
    elif mode == "parallel":
        o, state = wkv7_parallel(r, w_log, k, v, a, b, segment_ids=segment_ids, initial_state=initial_state)
    else:
        o, state = wkv7_chunk(r, w_log, k, v, a, b, segment_ids=segment_ids, initial_state=initial_state,
                              chunk_size=chunk_size)
    return o, (state if output_final_state else None)


__all__ = ["wkv7", "wkv7_step", "wkv7_recurrent", "wkv7_chunk", "wkv7_parallel", "MODES", "IMPLS"]
