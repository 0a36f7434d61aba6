"""Normalisation layers: RMSNorm (Zhang & Sennrich, 2019), its gated variant (Mamba-2, GLA) and
LayerNorm with a bias (Ba et al., 2016; RWKV's blocks), and RWKV's GroupNorm with one group per head.

    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * w
    GatedRMSNorm(x, z) = RMSNorm(x) * silu(z)      (or RMSNorm(x * silu(z)); either per group: Mamba-2's own)
    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * w + b

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


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        c = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...] + self.bias[...]).astype(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(z): the output norm-and-gate of Mamba-2 and the GLA/DeltaNet layers. With
    norm_before_gate=False, RMSNorm(x * silu(z)) (the official Mamba-2 module and its checkpoints). With
    `groups` > 1 the statistics are taken over each of that many equal groups of channels (the official
    Mamba-2's, in either order)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, norm_before_gate: bool = True, groups: int = 1,
                 rngs: nnx.Rngs | None = None):
        super().__init__(dim, eps=eps)
        self.norm_before_gate, self.groups = norm_before_gate, groups

    def __call__(self, x: Float[Array, "... D"], z: Float[Array, "... D"]) -> Float[Array, "... D"]:
        gate = jax.nn.silu(z.astype(jnp.float32))
        if self.norm_before_gate and self.groups == 1:
            return (super().__call__(x).astype(jnp.float32) * gate).astype(x.dtype)
        y = x.astype(jnp.float32) if self.norm_before_gate else x.astype(jnp.float32) * gate
        y = y.reshape(*x.shape[:-1], self.groups, -1)
        y = (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)).reshape(x.shape)
        y = y * self.weight[...]
        return (y * gate if self.norm_before_gate else y).astype(x.dtype)


def head_group_norm(o: Float[Array, "B T H V"], weight, bias, eps: float) -> Float[Array, "B T D"]:
    """GroupNorm with one group per head (float32), flattened to (B, T, H*V)."""
    B, T, H, V = o.shape
    o = o.astype(jnp.float32)
    mean = o.mean(-1, keepdims=True)
    var = jnp.square(o - mean).mean(-1, keepdims=True)
    return ((o - mean) * jax.lax.rsqrt(var + eps)).reshape(B, T, H * V) * weight + bias
