"""Gated linear attention (Yang et al., 2024): S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,
o_t = scale * q_t S_t, with a per-channel log-decay g <= 0 given by the caller.

See reference.py for the equations, chunk.py (stable secondary chunking) and parallel.py (quadratic
form, O(T^2 K) memory) for the fast forms, pallas.py (GPU, Triton) and pallas_tpu.py (TPU, Mosaic)
for the Pallas kernels (custom_vjp).

impl: "xla" runs the XLA form picked by `mode`; "reference" the token-by-token scan whatever the
mode; "pallas" the Pallas kernels of kernels.pallas_platform() (interpret mode on CPU, slow and
meant for tests), whose chunk is their own block size, not `chunk_size`; "auto" the kernels on GPU/TPU when
kernels.AUTO_PALLAS is set and pallas.supports() the call (more than 16 tokens), the XLA form
elsewhere.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, pallas_platform, use_pallas
from kernels.gla.chunk import gla_chunk
from kernels.gla.pallas import gla_pallas, supports
from kernels.gla.pallas_tpu import gla_pallas_tpu
from kernels.gla.parallel import gla_parallel
from kernels.gla.reference import gla_reference, gla_step

_FORMS = {"recurrent": gla_reference, "chunk": gla_chunk, "parallel": gla_parallel}


def gla(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
        g: Float[Array, "B T H K"], *, scale: float | None = None, segment_ids: Int[Array, "B T"] | None = None,
        initial_state: Float[Array, "B H K V"] | None = None, output_final_state: bool = False,
        mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32 or None).

    g: log of the forget gate alpha, <= 0 (not checked). mode: "recurrent", "chunk" or "parallel";
    all give the same result. impl: "auto", "reference", "xla" or "pallas" (module docstring).
    scale multiplies q; None means K^-1/2 (as flash-linear-attention's chunk_gla).
    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "gla")
    check_impl(impl, "gla")
    if context.active(q.shape[1]):
        run = lambda *a, **kw: gla(*a, scale=scale, mode=mode, chunk_size=chunk_size, impl=impl,
                                   output_final_state=True, **kw)
        decay = lambda q, k, v, g: jnp.exp(jnp.sum(g.astype(jnp.float32), axis=1))[..., None]  # (B, H, K, 1)
        o, state = context.split_diagonal(run, (q, k, v, g), decay=decay, segment_ids=segment_ids,
                                          initial_state=initial_state)
        return o, (state if output_final_state else None)
    o, state = run_form(_FORMS, q, k, v, g, pallas_gate=lambda: g, mode=mode, chunk_size=chunk_size, impl=impl,
                        scale=q.shape[-1] ** -0.5 if scale is None else scale, segment_ids=segment_ids,
                        initial_state=initial_state)
    return o, (state if output_final_state else None)


def run_form(forms: dict, q, k, v, *args, pallas_gate, mode: str, chunk_size: int, impl: str, **kwargs):
    """The one dispatch point of gla and of the ops that run GLA's Pallas kernels with a scalar gate
    (retention, linear_attention): the kernels with the log-decay `pallas_gate()` (B, T, H) or
    (B, T, H, K) where `use_pallas` holds, else the XLA form forms[mode](q, k, v, *args, **kwargs)
    (forms["recurrent"] for impl="reference"), chunk_size passed to the chunk form only."""
    if use_pallas(impl, supports(q, k, v)):
        kernel = gla_pallas_tpu if pallas_platform() == "tpu" else gla_pallas
        return kernel(q, k, v, pallas_gate(), **kwargs)
    mode = "recurrent" if impl == "reference" else mode
    if mode == "chunk":
        kwargs["chunk_size"] = chunk_size
    return forms[mode](q, k, v, *args, **kwargs)


__all__ = ["gla", "gla_step", "gla_pallas", "gla_pallas_tpu", "run_form"]
