"""The (gated) delta rule of DeltaNet, Gated DeltaNet and Kimi Delta Attention: one entry point, forms
chosen by `mode`; product.py runs Gated DeltaProduct's several steps per token on it.

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

alpha_t = exp(g_t) (g = None: alpha_t = 1, plain DeltaNet). g (B, T, H, K) is a per-key-channel decay,
Kimi Delta Attention's S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T.
See reference.py for the recurrence, chunk.py for the chunkwise WY/UT form, parallel.py for the
whole-sequence UT form, pallas.py (GPU, Triton) and pallas_tpu.py (TPU, Mosaic) for the Pallas
kernels (forward and backward, custom_vjp).

impl: "xla" runs the XLA form picked by `mode`; "reference" the token-by-token scan whatever the
mode; "pallas" the Pallas kernels of kernels.pallas_platform() (interpret mode on CPU, slow and
meant for tests), whose chunk is their own block size, not `chunk_size`; "auto" the kernels on
GPU/TPU when kernels.AUTO_PALLAS is set and pallas.supports() the call (more than 16 tokens), the
XLA form elsewhere. This function is the one dispatch point. Every form and both kernel families
take all three gate kinds: none, one per head (B, T, H) and one per key channel (B, T, H, K).
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, pallas_platform, use_pallas
from kernels.delta_rule.chunk import delta_rule_chunk
from kernels.delta_rule.pallas import delta_rule_pallas, supports
from kernels.delta_rule.pallas_tpu import delta_rule_pallas_tpu
from kernels.delta_rule.parallel import delta_rule_parallel
from kernels.delta_rule.reference import delta_rule_recurrent, delta_rule_step


def delta_rule(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    beta: Float[Array, "B T H"],
    g: Float[Array, "B T H"] | Float[Array, "B T H K"] | None = None,
    *,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    impl: str = "auto",
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"] | None]:
    """q, k (B, T, H, K) (the layers L2-normalise them), v (B, T, H, V), beta (B, T, H) in (0, 1),
    g (B, T, H) or (B, T, H, K) log-decay <= 0 or None, initial_state (B, H, K, V). scale defaults to K^-1/2.
    Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32 or None).
    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py)."""
    check_mode(mode, chunk_size, "delta_rule")
    check_impl(impl, "delta_rule")
    if context.active(q.shape[1]):
        run = lambda q, k, v, beta, *g, **kw: delta_rule(q, k, v, beta, *g, scale=scale, mode=mode,
                                                         chunk_size=chunk_size, impl=impl, output_final_state=True,
                                                         **kw)
        o, state = context.split_recurrence(run, (q, k, v, beta) + (() if g is None else (g,)), value=2,
                                            segment_ids=segment_ids, initial_state=initial_state)
        return o, (state if output_final_state else None)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(scale=scale, segment_ids=segment_ids, initial_state=initial_state)
    if impl == "reference":
        mode = "recurrent"
    if use_pallas(impl, supports(q, k, v)):
        kernel = delta_rule_pallas_tpu if pallas_platform() == "tpu" else delta_rule_pallas
        o, final = kernel(q, k, v, beta, g, **kwargs)
    elif mode == "recurrent":
        o, final = delta_rule_recurrent(q, k, v, beta, g, **kwargs)
    elif mode == "chunk":
        o, final = delta_rule_chunk(q, k, v, beta, g, chunk_size=chunk_size, **kwargs)
    else:
        o, final = delta_rule_parallel(q, k, v, beta, g, **kwargs)
    return o, (final.astype(jnp.float32) if output_final_state else None)


__all__ = ["delta_rule", "delta_rule_step", "delta_rule_pallas"]
