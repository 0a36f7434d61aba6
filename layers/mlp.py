"""Feed-forward: SwiGLU (Shazeer, 2020), y = W_down (silu(W_gate x) * W_up x), the default.

Options: `activation` "relu2" is the non-gated squared-ReLU MLP of Primer (So et al., 2021) and
Nemotron-H, y = W_down relu(W_up x)^2, without W_gate (its default width 4 d_model: the parameters of
SwiGLU's default width); "geglu" is GeGLU (Shazeer, 2020), y = W_down (gelu(W_gate x) * W_up x) with
GELU's tanh approximation (Griffin's and RecurrentGemma's MLP; transformers' gelu_pytorch_tanh).
`bias` adds b_gate, b_up (hidden_dim,) and b_down (d_model,) to the three products (RecurrentGemma's).
`activate` is that hidden activation alone, which the MoE's experts (layers/moe.py) share.
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

ACTIVATIONS = ("swiglu", "relu2", "geglu")
GATES = {"swiglu": jax.nn.silu, "geglu": lambda x: jax.nn.gelu(x, approximate=True)}  # the gated forms' σ


def activate(activation: str, up, gate=None):
    """An MLP's hidden activations from its up product and, for the gated forms, its gate product: relu(up)^2
    (relu2, no gate) or σ(gate) * up (swiglu, geglu)."""
    return jnp.square(jax.nn.relu(up)) if activation == "relu2" else GATES[activation](gate) * up


def default_hidden_dim(d_model: int) -> int:
    """8/3 d_model (the parameter count of a 4x GELU MLP), rounded up to a multiple of 32."""
    return -(-8 * d_model // 3 // 32) * 32


class NoFFN(nnx.Module):
    """No FFN: each block is its mixer alone, as Mamba's (the model's Block then has no FFN norm either)."""

    def __init__(self, d_model: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.d_model = d_model


class MLP(nnx.Module):
    """SwiGLU MLP; hidden_dim None = 8/3 d_model rounded up to 32 (4 d_model for relu2); activation: swiglu, geglu
    = W_down (gelu_tanh(W_gate x) * W_up x) (GeGLU: Griffin, RecurrentGemma), or relu2 = W_down relu(W_up x)^2
    without a gate (Primer, Nemotron-H); bias: biases on the gate, up and down products (RecurrentGemma); dtype:
    the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, hidden_dim: PosInt | None = None,
                 activation: Annotated[str, OneOf(*ACTIVATIONS)] = "swiglu", bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP: activation={activation!r}; expected one of {', '.join(ACTIVATIONS)}")
        F = hidden_dim or (4 * d_model if activation == "relu2" else default_hidden_dim(d_model))
        self.dtype, self.activation = dtype, activation
        into, out = axes("embed", "mlp"), axes("mlp", "embed")  # Megatron: columns in, rows out
        self.w_gate = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into) \
            if activation in GATES else None
        self.w_up = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (d_model, F)), **into)
        self.w_down = nnx.Param(nnx.initializers.normal(F ** -0.5)(rngs.params(), (F, d_model)), **out)
        zeros = lambda n, name: nnx.Param(jnp.zeros((n,), jnp.float32), **axes(name)) if bias else None
        self.b_gate, self.b_up, self.b_down = zeros(F, "mlp") if self.w_gate is not None else None, zeros(F, "mlp"), \
            zeros(d_model, "embed")

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        check_input(x, self.w_up.shape[0], None, "MLP")
        x = x.astype(self.dtype)
        w = lambda p: p[...].astype(self.dtype)

        def linear(a, weight, b):
            y = project(a, w(weight))
            return y if b is None else y + w(b)

        gate = None if self.w_gate is None else linear(x, self.w_gate, self.b_gate)  # relu2: no gate
        return linear(activate(self.activation, linear(x, self.w_up, self.b_up), gate), self.w_down, self.b_down)
