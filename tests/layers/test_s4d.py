"""S4D layer: what is specific to it (the protocol runs in test_conformance.py): the S4D-Lin and S4D-Inv
initialisations, the linear output variant, the state's shape, constructor checks and a bad value
named by its dotted config path."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.s4d import S4D
from zoo.config import from_dict

D, N = 8, 6


def test_initialisations_are_the_papers():
    lin, inv = (S4D(D, state_size=N, init=init, rngs=nnx.Rngs(0)) for init in ("lin", "inv"))
    n = np.arange(N // 2)
    for layer, imag in ((lin, np.pi * n), (inv, N / np.pi * (N / (2 * n + 1) - 1))):
        A, dt, _ = layer.ssm_params()
        np.testing.assert_allclose(np.asarray(A.real), -0.5, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(A.imag), np.broadcast_to(imag, (D, N // 2)), rtol=1e-6)
        assert float(dt.min()) >= 1e-3 and float(dt.max()) <= 0.1


def test_linear_output_and_state():
    layer = S4D(D, state_size=N, output="linear", rngs=nnx.Rngs(0))
    assert layer.out_proj.kernel.shape == (D, D)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, D)), jnp.float32)
    state = layer.init_state(2, 1 << 20)
    assert state.ssm.shape == (2, D, N)  # real pairs of N / 2 modes, whatever max_len
    full = nnx.jit(lambda m, x: m(x))(layer, x)
    y, state = nnx.jit(lambda m, x, s: m.decode(x, s))(layer, x[:, :5], state)
    y2, _ = nnx.jit(lambda m, x, s: m.decode(x, s))(layer, x[:, 5:], state)
    np.testing.assert_allclose(np.concatenate([y, y2], 1), full, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [({"state_size": 5}, "state_size=5"), ({"init": "diag"}, "init='diag'"),
                                             ({"impl": "pallas"}, "impl='pallas'"), ({"dt_min": 0.5}, "dt_min")])
def test_constructor_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: S4D(D, rngs=nnx.Rngs(0), **kwargs))


def test_bad_value_is_named_by_its_path():
    with pytest.raises(ValueError, match="model.mixer.*state_size=7"):
        from_dict({"model": {"d_model": 16, "mixer": {"kind": "s4d", "state_size": 7}}})
