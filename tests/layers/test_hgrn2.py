"""HGRN2: what is specific to it (the protocol runs in test_conformance.py): the forget gate's lower
bound against the paper's formula, its initial value by depth, and constructor errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.hgrn2 import HGRN2
from tests.util import assert_close


def test_forget_gate_is_lower_bounded_by_depth():
    z = np.random.default_rng(0).standard_normal((1, 3, 8)) * 4
    sigmoid = 1 / (1 + np.exp(-z))
    z = jnp.asarray(z, jnp.float32)
    first = HGRN2(8, num_heads=2, layer_id=0, num_layers=4, rngs=nnx.Rngs(0))
    assert first.bound_logit is None  # layer 0: no bound, f = sigmoid(z)
    assert_close(np.exp(first.forget_gate(z)), sigmoid, what="layer 0 f")
    for layer in (1, 3):
        m = HGRN2(8, num_heads=2, layer_id=layer, num_layers=4, rngs=nnx.Rngs(0))
        gamma = layer / 4  # fla's initial bound
        assert_close(jax.nn.sigmoid(m.bound_logit[...]), np.full(8, gamma), what="initial bound")
        assert_close(np.exp(m.forget_gate(z)), gamma + (1 - gamma) * sigmoid, what=f"layer {layer} f")


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=16"):
        HGRN2(16, num_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_id=2"):
        HGRN2(16, layer_id=2, num_layers=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mode"):
        HGRN2(16, mode="fused", rngs=nnx.Rngs(0))
