"""Retention (Sun et al., 2023, "Retentive Network: A Successor to Transformer for Large Language
Models", the recurrent representation), token by token: the ground truth for chunk.py and parallel.py.

    S_t = gamma_h S_{t-1} + k_t v_t^T        S_t in R^{K x V}, one fixed gamma_h in (0, 1] per head
    o_t = scale * q_t S_t

Code names: `state` is S (B, H, K, V); `log_gamma` is log(gamma) (H,). The paper writes the
recurrence with K^T V for row vectors; the rotary/xPos rotation of q and k belongs to the layer.
With `segment_ids`, S is set to zero before the update at every document start; token 0 continues
`initial_state`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def retention_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
                   log_gamma: Float[Array, " H"], state: Float[Array, "B H K V"], scale: float = 1.0):
    """One token: S <- gamma S + k v^T, o = scale * q S. Returns (o (B, H, V), S), both float32."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    gamma = jnp.exp(log_gamma.astype(jnp.float32))[None, :, None, None]
    state = gamma * state + k[..., :, None] * v[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q * scale, state), state


def retention_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                        log_gamma: Float[Array, " H"], *, scale: float = 1.0,
                        segment_ids: Int[Array, "B T"] | None = None,
                        initial_state: Float[Array, "B H K V"] | None = None):
    """Scan of `retention_step` over time. Returns (o (B, T, H, V) in q's dtype, S float32)."""
    B, T, H, K = q.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    step = lambda S, q_t, k_t, v_t: retention_step(q_t, k_t, v_t, log_gamma, S, scale)
    o, state = scan_documents(step, state, (q, k, v), segment_ids)
    return o.astype(q.dtype), state
