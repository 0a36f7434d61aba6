"""Retention (RetNet, Sun et al., 2023): S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = scale * q_t S_t.

One fixed decay gamma_h per head, handled in log space inside every form. See reference.py for the
equations, chunk.py and parallel.py for the fast forms. impl="pallas" runs the GLA Pallas kernels
(kernels/gla/pallas.py, or pallas_tpu.py where kernels.pallas_platform() is "tpu") with the scalar
gate g = log gamma_h at every token; impl="auto" does so on GPU/TPU when kernels.AUTO_PALLAS is set
and they support the call, and runs the XLA form picked by `mode` elsewhere; "reference" is
the token-by-token scan; "xla" the form picked by `mode`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context
from kernels.gla import run_form
from kernels.retention.chunk import retention_chunk
from kernels.retention.parallel import retention_parallel
from kernels.retention.reference import retention_reference, retention_step

_FORMS = {"recurrent": retention_reference, "chunk": retention_chunk, "parallel": retention_parallel}


def retention(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
              gamma: Float[Array, " H"], *, segment_ids: Int[Array, "B T"] | None = None,
              initial_state: Float[Array, "B H K V"] | None = None, output_final_state: bool = False,
              mode: str = "chunk", chunk_size: int = 64, impl: str = "auto", scale: float | None = None):
    """Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32 or None).

    gamma (H,) in (0, 1]: the per-head decay. mode: "recurrent", "chunk" or "parallel"; all give the
    same result. impl: "auto", "reference", "xla" or "pallas" (module docstring). scale multiplies q;
    None means K^-1/2 as in the paper (which scales k by the same factor).
    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "retention")
    check_impl(impl, "retention")
    if context.active(q.shape[1]):
        run = lambda q, k, v, gamma, **kw: retention(q, k, v, gamma, mode=mode, chunk_size=chunk_size, impl=impl,
                                                     scale=scale, output_final_state=True, **kw)
        decay = lambda q, k, v, gamma: (gamma.astype(jnp.float32) ** q.shape[1])[:, None, None]  # (H, 1, 1)
        o, state = context.split_diagonal(run, (q, k, v), (jnp.asarray(gamma),), decay=decay, segment_ids=segment_ids,
                                          initial_state=initial_state)
        return o, (state if output_final_state else None)
    log_gamma = jnp.log(jnp.asarray(gamma, jnp.float32))
    o, state = run_form(_FORMS, q, k, v, log_gamma, pallas_gate=lambda: jnp.broadcast_to(log_gamma, v.shape[:3]),
                        mode=mode, chunk_size=chunk_size, impl=impl, segment_ids=segment_ids,
                        scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["retention", "retention_step"]
