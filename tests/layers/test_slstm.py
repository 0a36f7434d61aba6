"""sLSTM layer specifics (the protocol runs in tests/layers/test_conformance.py, the cell in
tests/kernels/test_slstm.py): the official initialisation and the constructor's errors."""

import numpy as np
import pytest
from flax import nnx

from layers import SLSTM


def test_initialisation_is_the_official_one():
    layer = SLSTM(16, num_heads=2, layer_id=3, num_layers=4, rngs=nnx.Rngs(0))
    b, R = np.asarray(layer.bias[...]), np.asarray(layer.recurrent[...])
    assert not R.any() and not np.delete(b, 1, axis=0).any()  # R and the i, z, o biases start at zero
    ramp = 5 - 12 * np.linspace(0, 1, 8) ** (0.3 + 1.3 * 3 / 3)  # powerlaw_blockdependent, the last layer
    np.testing.assert_allclose(b[1], np.stack([ramp, ramp]), atol=1e-5)
    assert abs(np.asarray(layer.w_in[...]).std() - (2 / (5 * 16)) ** 0.5) < 0.03
    assert SLSTM(16, num_heads=2, conv_size=0, rngs=nnx.Rngs(0)).conv is None


@pytest.mark.parametrize("kwargs,message", [
    ({"num_heads": 3}, "num_heads=3 does not divide d_model=16"),
    ({"impl": "pallas"}, "impl='pallas' has no kernel"),
    ({"forget_gate": "tanh"}, "forget_gate='tanh'"),
    ({"layer_id": 2, "num_layers": 2}, r"layer_id=2 must be in \[0, num_layers=2\)"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SLSTM(16, **kwargs, rngs=nnx.Rngs(0))
