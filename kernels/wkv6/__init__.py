"""WKV6, the time-mixing recurrence of RWKV-6 "Finch" (Peng et al., 2024, arXiv:2404.05892).

    o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),   S_t = diag(w_t) S_{t-1} + k_t v_t^T

State (B, H, K, V) float32. The op takes log w_t <= 0 (the model's w_t = exp(-exp(d_t))).

Modes: "recurrent" (reference.py, a lax.scan), "chunk" (chunk.py, the stable chunkwise form) and
"parallel" (parallel.py, the masked quadratic form over the whole sequence, built from the same
stable scores: O(T^2) work and O(T (16 + T/16) K) memory per head, no scan).

impl: "xla" runs the form picked by `mode`; "reference" the token-by-token scan whatever the mode;
"pallas" the GLA Pallas kernels on shifted inputs (pallas.py; Triton on GPU, Mosaic on TPU,
interpret mode on CPU, meant for tests); "auto" those kernels on GPU/TPU when kernels.AUTO_PALLAS is set
and they support the call, the XLA form elsewhere. This function is the one dispatch point.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, use_pallas
from kernels.gla.pallas import supports
from kernels.wkv6.chunk import wkv6_chunk
from kernels.wkv6.pallas import wkv6_pallas
from kernels.wkv6.parallel import wkv6_parallel
from kernels.wkv6.reference import wkv6_recurrent, wkv6_step


def wkv6(r: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
         log_w: Float[Array, "B T H K"], u: Float[Array, "H K"], *,
         segment_ids: Int[Array, "B T"] | None = None, initial_state: Float[Array, "B H K V"] | None = None,
         output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in r's dtype, final state (B, H, K, V) float32 or None).

    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "wkv6")
    check_impl(impl, "wkv6")
    if context.active(r.shape[1]):
        run = lambda *a, **kw: wkv6(*a, mode=mode, chunk_size=chunk_size, impl=impl, output_final_state=True, **kw)
        decay = lambda r, k, v, log_w, u: jnp.exp(jnp.sum(log_w.astype(jnp.float32), axis=1))[..., None]  # (B, H, K, 1)
        o, state = context.split_diagonal(run, (r, k, v, log_w), (u,), decay=decay, segment_ids=segment_ids,
                                          initial_state=initial_state)
        return o, (state if output_final_state else None)
    B, T, H, K = r.shape
    if k.shape != r.shape or log_w.shape != r.shape or v.shape[:3] != (B, T, H) or u.shape != (H, K):
        raise ValueError(f"wkv6: shapes r{r.shape} k{k.shape} v{v.shape} log_w{log_w.shape} u{u.shape} do not "
                         "match r, k, log_w (B, T, H, K), v (B, T, H, V), u (H, K)")
    if use_pallas(impl, supports(r, k, v)):
        o, state = wkv6_pallas(r, k, v, log_w, u, segment_ids=segment_ids, initial_state=initial_state)
    elif mode == "recurrent" or impl == "reference":
        o, state = wkv6_recurrent(r, k, v, log_w, u, segment_ids=segment_ids, initial_state=initial_state)
    elif mode == "parallel":
        o, state = wkv6_parallel(r, k, v, log_w, u, segment_ids=segment_ids, initial_state=initial_state)
    else:
        o, state = wkv6_chunk(r, k, v, log_w, u, segment_ids=segment_ids, initial_state=initial_state,
                              chunk_size=chunk_size)
    return o, (state if output_final_state else None)


__all__ = ["wkv6", "wkv6_step", "wkv6_recurrent", "wkv6_chunk", "wkv6_parallel", "wkv6_pallas"]
