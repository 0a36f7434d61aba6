"""Gated DeltaNet-2 reference (NVIDIA 2026, "Gated DeltaNet-2: Decoupling Erase and Write in Linear
Attention", arXiv 2605.22791): the recurrence token by token, in float32, as the equations read.

    S_t = (I - k_t (b_t ⊙ k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t ⊙ v_t)^T,    o_t = scale S_t^T q_t

with the (K, V) state of every op here: decay each key row, read the gated erase (b_t ⊙ k_t)^T of the
decayed state, write w_t ⊙ v_t minus it along k_t. Code names: g = log alpha_t (<= 0) per key channel, b
the erase gate per key channel, w the write gate per value channel.

Document resets (segment_ids): S_{t-1} is replaced by zero at a document start t >= 1.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def gdn2_step(S: Float[Array, "B H K V"], q: Float[Array, "B H K"], k: Float[Array, "B H K"],
              v: Float[Array, "B H V"], g: Float[Array, "B H K"], b: Float[Array, "B H K"],
              w: Float[Array, "B H V"]):
    """One token (q already scaled): returns (o_t (B, H, V), S_t (B, H, K, V)), all float32."""
    S = jnp.exp(g)[..., None] * S  # diag(alpha_t) S_{t-1}
    erased = jnp.einsum("bhk,bhkv->bhv", b * k, S)  # (b ⊙ k)^T diag(alpha) S
    S = S + k[..., :, None] * (w * v - erased)[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, S), S


def gdn2_recurrent(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                   g: Float[Array, "B T H K"], b: Float[Array, "B T H K"], w: Float[Array, "B T H V"], *,
                   scale: float, segment_ids: Int[Array, "B T"] | None = None,
                   initial_state: Float[Array, "B H K V"] | None = None):
    """lax.scan of `gdn2_step` over time. Returns (o (B, T, H, V) in q's dtype, S_T float32)."""
    B, T, H, K = q.shape
    S = entering_state(initial_state, (B, H, K, v.shape[-1]))
    xs = tuple(x.astype(jnp.float32) for x in (q * scale, k, v, g, b, w))
    o, S = scan_documents(gdn2_step, S, xs, segment_ids)
    return o.astype(q.dtype), S
