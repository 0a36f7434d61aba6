"""Rotary position embeddings (Su et al., 2021, RoFormer), the rotate-half layout of GPT-NeoX/Llama.

    x'_i       = x_i cos(p θ_i) - x_{i+D/2} sin(p θ_i)     θ_i = base^(-2i/D)
    x'_{i+D/2} = x_i sin(p θ_i) + x_{i+D/2} cos(p θ_i)
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_rotary(x: Float[Array, "B T H K"], positions: Int[Array, "B T"], base: float = 10000.0):
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, K/2)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)
