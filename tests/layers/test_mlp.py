"""MLP layer: the SwiGLU default and the non-gated squared-ReLU option (activation="relu2", Nemotron-H)."""

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
    with pytest.raises(ValueError, match="activation='gelu'"):
        MLP(16, activation="gelu", rngs=nnx.Rngs(0))
