"""Stick-breaking attention's dense masked form (kernels/stickbreaking/reference.py for the equations):
all the (T, S) logits of a head group at once, the sum over later keys as a reverse cumulative sum.

    log A_ij = log σ(z_ij) + Σ_{l > j} m_il log σ(-z_il)

The exclusive suffix sum is the inclusive one (lax.cumsum, reverse=True) shifted by one key, so no
difference of two large sums is taken. Logits, logs and the weighted sum accumulate in float32; memory is
O(B H T S), the quadratic cost of a dense attention (no blocked or Pallas form here).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def stickbreaking_xla(q: Float[Array, "B T H K"], k: Float[Array, "B _ _ K"], v: Float[Array, "B _ _ V"],
                      seen: Bool[Array, "B T S"], scale: float, kv_heads_first: bool = False):
    """o (B, T, H, V) float32 and r (B, T, H) float32; k, v (B, G, S, ...) with kv_heads_first (a cache's layout)."""
    B, T, H, _ = q.shape
    G = k.shape[1 if kv_heads_first else 2]
    kv = "bgs" if kv_heads_first else "bsg"
    q = q.reshape(B, T, G, H // G, -1)  # (B, T, G, R, K)
    z = jnp.einsum(f"btgrk,{kv}k->bgrts", q, k, preferred_element_type=jnp.float32) * scale  # (B, G, R, T, S)
    m = seen[:, None, None]  # (B, 1, 1, T, S)
    log_keep = jnp.where(m, jax.nn.log_sigmoid(-z), 0.0)
    after = jax.lax.cumsum(log_keep, axis=4, reverse=True)  # Σ_{l >= j}
    after = jnp.concatenate([after[..., 1:], jnp.zeros_like(after[..., :1])], axis=-1)  # Σ_{l > j}
    a = jnp.where(m, jnp.exp(jax.nn.log_sigmoid(z) + after), 0.0)  # (B, G, R, T, S)
    o = jnp.einsum(f"bgrts,{kv}v->btgrv", a, v.astype(jnp.float32))  # (B, T, G, R, V)
    r = jnp.exp(jnp.sum(log_keep, axis=-1))  # (B, G, R, T)
    return o.reshape(B, T, H, -1), r.transpose(0, 3, 1, 2).reshape(B, T, H)  # (B, T, H, V), (B, T, H)
