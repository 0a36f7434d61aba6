"""SwiGLU feed-forward (Shazeer, 2020): y = W_down (silu(W_gate x) * W_up x)."""


import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from layers.linear import project
from layers.options import PosInt
from layers.shapes import check_input
from layers.sharding import axes


def default_hidden_dim(d_model: int) -> int:
    """8/3 d_model (the parameter count of a 4x GELU MLP), rounded up to a multiple of 32."""
    return -(-8 * d_model // 3 // 32) * 32


class NoFFN(nnx.Module):
    """No FFN: each block is its mixer alone, as Mamba's (the model's Block then has no FFN norm either)."""

    def __init__(self, d_model: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.d_model = d_model


class MLP(nnx.Module):
    """SwiGLU MLP; hidden_dim None = 8/3 d_model rounded up to 32; dtype: the compute dtype (parameters stay
    float32)."""

    def __init__(self, d_model: int, *, hidden_dim: PosInt | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        F = hidden_dim or default_hidden_dim(d_model)
        self.dtype = dtype
        into, out = axes("embed", "mlp"), axes("mlp", "embed")  # Megatron: columns in, rows out
        self.w_gate = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into)
        self.w_up = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into)
        self.w_down = nnx.Param(nnx.initializers.normal(F ** -0.5)(rngs.params(), (F, d_model)), **out)

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        check_input(x, self.w_gate.shape[0], None, "MLP")
        x = x.astype(self.dtype)
        w = lambda p: p[...].astype(self.dtype)
        h = jax.nn.silu(project(x, w(self.w_gate))) * project(x, w(self.w_up))
        return project(h, w(self.w_down))
