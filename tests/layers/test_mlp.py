"""MLP layer: the SwiGLU default, the non-gated squared-ReLU option (activation="relu2", Nemotron-H) and GeGLU with
biases (activation="geglu", bias=True: RecurrentGemma)."""

import jax
import numpy as np
import pytest
from flax import nnx

from layers.mlp import MLP
from tests.util import assert_close, randn


def test_relu2_is_the_squared_relu_of_the_up_projection_without_a_gate():
    mlp = MLP(16, activation="relu2", rngs=nnx.Rngs(0))
    assert mlp.w_gate is None and mlp.w_up.shape == (16, 64)  # default width 4 d_model
    x = randn(1, (2, 5, 16))
    up = np.asarray(x) @ np.asarray(mlp.w_up[...])
    assert_close(mlp(x), np.maximum(up, 0) ** 2 @ np.asarray(mlp.w_down[...]), 1e-5, "relu2")
    swiglu = MLP(16, hidden_dim=24, rngs=nnx.Rngs(0))
    gate = np.asarray(x) @ np.asarray(swiglu.w_gate[...])
    up = np.asarray(x) @ np.asarray(swiglu.w_up[...])
    want = np.asarray(jax.nn.silu(gate)) * up @ np.asarray(swiglu.w_down[...])
    assert_close(swiglu(x), want, 1e-5, "swiglu")
    assert swiglu.b_gate is None and swiglu.b_up is None and swiglu.b_down is None  # no bias by default
    geglu = MLP(16, hidden_dim=24, activation="geglu", bias=True, rngs=nnx.Rngs(0))
    for i, b in enumerate((geglu.b_gate, geglu.b_up, geglu.b_down)):
        b[...] = randn(2 + i, b.shape, scale=0.5)
    p = {n: np.asarray(getattr(geglu, n)[...]) for n in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")}
    gate = np.asarray(x) @ p["w_gate"] + p["b_gate"]
    tanh_gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
    want = tanh_gelu * (np.asarray(x) @ p["w_up"] + p["b_up"]) @ p["w_down"] + p["b_down"]
    assert_close(geglu(x), want, 1e-5, "geglu")
    with pytest.raises(ValueError, match="activation='gelu'"):
        MLP(16, activation="gelu", rngs=nnx.Rngs(0))
