"""WKV7, the generalised delta rule of RWKV-7 "Goose" (Peng et al., 2025, arXiv:2503.14456).

In our (K, V) state convention (the transpose of the paper's (V, K) one; see reference.py):

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T r_t

State (B, H, K, V) float32. The op takes w_log = log w_t <= 0; the model passes a = -kappa^,
b = kappa^ * a_icl.

Modes: "recurrent" (reference.py, a lax.scan), "chunk" (chunk.py, the WY/UT chunked form, exact for
any T) and "parallel" (parallel.py, the UT transform over the whole sequence: one T x T triangular
solve, no scan).

impl: "xla" runs the form picked by `mode`; "reference" the token-by-token scan whatever the mode;
"pallas" the Pallas kernels of kernels.pallas_platform(): pallas.py (Triton; fused chunks, forward
and backward, custom_vjp) on GPU, pallas_tpu.py (Mosaic TPU) on TPU, interpret mode on CPU (slow,
meant for tests), with their own chunk, not `chunk_size`; "auto" the kernels on GPU/TPU when
kernels.AUTO_PALLAS is set and pallas.supports() the call (more than 16 tokens), the XLA form of
`mode` elsewhere. This function is the one dispatch point.
"""

from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, pallas_platform, use_pallas
from kernels.wkv7.chunk import wkv7_chunk
from kernels.wkv7.pallas import supports, wkv7_pallas
from kernels.wkv7.pallas_tpu import wkv7_pallas_tpu
from kernels.wkv7.parallel import wkv7_parallel
from kernels.wkv7.reference import wkv7_recurrent, wkv7_step


def wkv7(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
         v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
         segment_ids: Int[Array, "B T"] | None = None, initial_state: Float[Array, "B H K V"] | None = None,
         output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto",
         max_decay: float | None = None):
    """Returns (o (B, T, H, V) in r's dtype, final state (B, H, K, V) float32 or None).

    max_decay: a bound the caller guarantees on -w_log (the model's is e^{-0.5}); the chunk and
    parallel forms then score whole blocks by matmuls (kernels/wkv6/chunk.py, decayed_scores), about
    3x faster at 32 tokens. A decay past the bound overflows there: it is a promise, not a clamp.

    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "wkv7")
    check_impl(impl, "wkv7")
    if context.active(r.shape[1]):
        run = lambda *a, **kw: wkv7(*a, mode=mode, chunk_size=chunk_size, impl=impl, max_decay=max_decay,
                                    output_final_state=True, **kw)
        o, state = context.split_recurrence(run, (r, w_log, k, v, a, b), value=3, segment_ids=segment_ids,
                                            initial_state=initial_state)
        return o, (state if output_final_state else None)
    B, T, H, K = r.shape
    if any(x.shape != r.shape for x in (w_log, k, a, b)) or v.shape[:3] != (B, T, H):
        raise ValueError(f"wkv7: shapes r{r.shape} w_log{w_log.shape} k{k.shape} v{v.shape} a{a.shape} "
                         f"b{b.shape} do not match r, w_log, k, a, b (B, T, H, K), v (B, T, H, V)")
    kwargs = dict(segment_ids=segment_ids, initial_state=initial_state)
    if use_pallas(impl, supports(r, k, v)):
        kernel = wkv7_pallas_tpu if pallas_platform() == "tpu" else wkv7_pallas
        o, state = kernel(r, w_log, k, v, a, b, **kwargs)
    elif mode == "recurrent" or impl == "reference":
        o, state = wkv7_recurrent(r, w_log, k, v, a, b, **kwargs)
    elif mode == "parallel":
        o, state = wkv7_parallel(r, w_log, k, v, a, b, max_decay=max_decay, **kwargs)
    else:
        o, state = wkv7_chunk(r, w_log, k, v, a, b, chunk_size=chunk_size, max_decay=max_decay, **kwargs)
    return o, (state if output_final_state else None)


__all__ = ["wkv7", "wkv7_step", "wkv7_recurrent", "wkv7_chunk", "wkv7_parallel", "wkv7_pallas"]
