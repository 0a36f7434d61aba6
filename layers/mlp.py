"""Feed-forward: SwiGLU (Shazeer, 2020), y = W_down (silu(W_gate x) * W_up x), the default.

Options: `activation` "relu2" is the non-gated squared-ReLU MLP of Primer (So et al., 2021) and
Nemotron-H, y = W_down relu(W_up x)^2, without W_gate (its default width 4 d_model: the parameters of
SwiGLU's default width).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from layers.linear import project
from layers.options import OneOf, PosInt
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
    """SwiGLU MLP; hidden_dim None = 8/3 d_model rounded up to 32 (4 d_model for relu2); activation: swiglu, or relu2
    = W_down relu(W_up x)^2 without a gate (Primer, Nemotron-H); dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, hidden_dim: PosInt | None = None,
                 activation: Annotated[str, OneOf("swiglu", "relu2")] = "swiglu", dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"MLP: activation={activation!r}; expected 'swiglu' or 'relu2'")
        F = hidden_dim or (default_hidden_dim(d_model) if activation == "swiglu" else 4 * d_model)
        self.dtype = dtype
        into, out = axes("embed", "mlp"), axes("mlp", "embed")  # Megatron: columns in, rows out
        self.w_gate = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into) \
            if activation == "swiglu" else None
        self.w_up = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into)
        self.w_down = nnx.Param(nnx.initializers.normal(F ** -0.5)(rngs.params(), (F, d_model)), **out)

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        check_input(x, self.w_up.shape[0], None, "MLP")
        x = x.astype(self.dtype)
        w = lambda p: p[...].astype(self.dtype)
        up = project(x, w(self.w_up))
        h = jnp.square(jax.nn.relu(up)) if self.w_gate is None else jax.nn.silu(project(x, w(self.w_gate))) * up
        return project(h, w(self.w_down))
