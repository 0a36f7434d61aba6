"""MultiScaleRetention layer against the mixer protocol (modes agree, prefill + decode equals the full
pass, packed equals alone, fixed-size state, gradients reach every parameter; see
test_linear_attention.check_protocol), plus its fixed decays and constructor errors."""

import numpy as np
import pytest
from flax import nnx

from layers.retnet import MultiScaleRetention
from tests.layers.test_linear_attention import D, check_protocol


def test_protocol():
    make = lambda **kw: MultiScaleRetention(D, num_heads=2, chunk_size=8, rngs=nnx.Rngs(0), **kw)
    layer = make()
    assert (layer.key_dim, layer.value_dim) == (D, 2 * D)  # the paper's allocation: V is twice as wide
    np.testing.assert_allclose(layer.gamma, [1 - 1 / 32, 1 - 1 / 64])
    check_protocol(make)


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 must divide"),
                        (dict(num_heads=16), "must be even for rotary"),
                        (dict(mode="fused_chunk"), "mode='fused_chunk'")]:
        with pytest.raises(ValueError, match=msg):
            MultiScaleRetention(D, rngs=nnx.Rngs(0), **kwargs)
