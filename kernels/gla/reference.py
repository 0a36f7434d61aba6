"""Gated linear attention (Yang et al., 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", the recurrent form), token by token: the ground truth for chunk.py and parallel.py.

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T        alpha_t = exp(g_t) in (0, 1]^K, S_t in R^{K x V}
    o_t = scale * q_t S_t

Code names: `state` is S (B, H, K, V); `g` is log(alpha) (B, T, H, K), <= 0, given by the caller (the
layer makes it from a low-rank projection). With `segment_ids`, S is set to zero before the
update at every document start; token 0 continues `initial_state`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def gla_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
             g: Float[Array, "B H K"], state: Float[Array, "B H K V"], scale: float = 1.0):
    """One token: S <- diag(exp(g)) S + k v^T, o = scale * q S. Returns (o (B, H, V), S), float32."""
    q, k, v, g = (x.astype(jnp.float32) for x in (q, k, v, g))
    state = jnp.exp(g)[..., None] * state + k[..., :, None] * v[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q * scale, state), state


def gla_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                  g: Float[Array, "B T H K"], *, scale: float = 1.0,
                  segment_ids: Int[Array, "B T"] | None = None,
                  initial_state: Float[Array, "B H K V"] | None = None):
    """Scan of `gla_step` over time. Returns (o (B, T, H, V) in q's dtype, S float32)."""
    B, T, H, K = q.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    step = lambda S, q_t, k_t, v_t, g_t: gla_step(q_t, k_t, v_t, g_t, S, scale)
    o, state = scan_documents(step, state, (q, k, v, g), segment_ids)
    return o.astype(q.dtype), state
