"""Causal linear attention without decay: S_t = S_{t-1} + k_t v_t^T, o_t = scale * q_t S_t.

Katharopoulos et al., 2020. The op takes q and k with the feature map already applied and has no
normaliser; see reference.py for the equations, chunk.py and parallel.py for the fast forms.
impl="pallas" runs the GLA Pallas kernels (kernels/gla/pallas.py, or pallas_tpu.py where
kernels.pallas_platform() is "tpu") with a zero scalar gate (no decay); impl="auto" does so on
GPU/TPU when kernels.AUTO_PALLAS is set and they support the call, and runs the XLA form picked by `mode`
elsewhere; "reference" is the token-by-token scan; "xla" the form picked by `mode`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context
from kernels.gla import run_form
from kernels.linear_attention.chunk import linear_attention_chunk
from kernels.linear_attention.parallel import linear_attention_parallel
from kernels.linear_attention.reference import linear_attention_reference, linear_attention_step

_FORMS = {"recurrent": linear_attention_reference, "chunk": linear_attention_chunk,
          "parallel": linear_attention_parallel}


def linear_attention(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"], *,
                     segment_ids: Int[Array, "B T"] | None = None,
                     initial_state: Float[Array, "B H K V"] | None = None, output_final_state: bool = False,
                     mode: str = "chunk", chunk_size: int = 64, impl: str = "auto", scale: float | None = None):
    """Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32 or None).

    mode: "recurrent" (token-by-token scan), "chunk" (chunkwise parallel, chunk_size tokens) or
    "parallel" (quadratic masked form); all give the same result. impl: "auto", "reference", "xla"
    or "pallas" (module docstring). scale multiplies q (None means 1).
    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "linear_attention")
    check_impl(impl, "linear_attention")
    if context.active(q.shape[1]):
        run = lambda *a, **kw: linear_attention(*a, mode=mode, chunk_size=chunk_size, impl=impl, scale=scale,
                                                output_final_state=True, **kw)
        o, state = context.split_diagonal(run, (q, k, v), decay=lambda *_: jnp.float32(1), segment_ids=segment_ids,
                                          initial_state=initial_state)  # no decay: the state only adds up
        return o, (state if output_final_state else None)
    o, state = run_form(_FORMS, q, k, v, pallas_gate=lambda: jnp.zeros(v.shape[:3], jnp.float32), mode=mode,
                        chunk_size=chunk_size, impl=impl, scale=1.0 if scale is None else scale,
                        segment_ids=segment_ids, initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["linear_attention", "linear_attention_step"]
