"""Normalisation layers: RMSNorm (Zhang & Sennrich, 2019) and its gated variant (Mamba-2, GLA).

    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w
    GatedRMSNorm(x, z) = RMSNorm(x) * silu(z)

Statistics are computed in float32 whatever the input dtype; the output has the input's dtype.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...]).astype(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(z): the output norm-and-gate of Mamba-2 and the GLA/DeltaNet layers."""

    def __call__(self, x: Float[Array, "... D"], z: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return (super().__call__(x).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
