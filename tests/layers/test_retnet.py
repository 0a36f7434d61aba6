"""MultiScaleRetention: what is specific to it (the protocol runs in test_conformance.py): the paper's
widths and fixed decays, and constructor errors."""

import numpy as np
import pytest
from flax import nnx

from layers.retnet import MultiScaleRetention

D = 16


def test_widths_and_decays_are_the_papers():
    layer = MultiScaleRetention(D, num_heads=2, rngs=nnx.Rngs(0))
    assert (layer.key_dim, layer.value_dim) == (D, 2 * D)  # the paper's allocation: V is twice as wide
    np.testing.assert_allclose(layer.gamma, [1 - 1 / 32, 1 - 1 / 64])


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 must divide"),
                        (dict(num_heads=16), "must be even for rotary"),
                        (dict(mode="fused_chunk"), "mode='fused_chunk'")]:
        with pytest.raises(ValueError, match=msg):
            MultiScaleRetention(D, rngs=nnx.Rngs(0), **kwargs)
