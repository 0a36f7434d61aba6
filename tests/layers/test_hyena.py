"""Hyena layer: what is specific to it (the protocol runs in test_conformance.py): the implicit filter
is one function of the lag (any length, any cache, the formula of the paper and safari), prefill by FFT
in pieces and from rolled-back rows of different lengths equals the full pass, the cache's size, and
constructor checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.hyena import Hyena
from tests.layers.conformance import perturbed

D = 8
make = lambda **kw: Hyena(D, filter_order=8, filter_emb_dim=5, filter_inner_layers=1, max_seq_len=32,
                          rngs=nnx.Rngs(0), **kw)


def test_filter_is_one_function_of_the_lag():
    layer = make()
    short, long = layer.filters(7), layer.filters(50)  # 50 > max_seq_len: lags past it take the same formula
    np.testing.assert_allclose(short, long[:, :7], rtol=1e-6, atol=1e-7)
    # h(t) = window(t) FFN(PE(t)) read off the parameters at one lag, t = 5, with L = 32
    t, L = 5, 32
    f = np.linspace(1e-4, 1, 2)  # bands = (5 - 1) / 2
    a = np.concatenate([[t / (L - 1)], np.cos(2 * np.pi * f * t / L), -np.sin(2 * np.pi * f * t / L)])
    for lin in layer.filter_mlp:
        a = np.sin(np.asarray(layer.filter_freq[...]) * (a @ np.asarray(lin.kernel[...]) + np.asarray(lin.bias[...])))
    h = a @ np.asarray(layer.filter_out.kernel[...])  # (D N,)
    h = h * np.exp(-t / (L - 1) * np.abs(np.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, 2 * D)))
    np.testing.assert_allclose(np.asarray(short[:, t]), h.reshape(D, 2).T, rtol=1e-5, atol=1e-6)


def test_prefill_in_pieces_equals_the_full_pass():
    """FFT prefills (T > 1) continue the cache, also for rows whose index differs (after a rollback)."""
    layer = perturbed(make())
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 19, D)), jnp.float32)

    @nnx.jit
    def run(m, x):
        full = m(x)
        y1, s = m.decode(x[:, :6], m.init_state(2, 24))
        y2, s = m.decode(x[:, 6:13], s)
        y3, _ = m.decode(x[:, 13:], s)
        # row 1 drops 2 of the 7 tokens of the second call, then decodes them again with the rest
        _, stepped = m.decode(x[:, 6:13], m.decode(x[:, :6], m.init_state(2, 24))[1], steps=True)
        rolled = m.rollback(stepped, jnp.asarray([0, 2], jnp.int32))
        y4, _ = m.decode(jnp.stack([x[0, 13:17], x[1, 11:15]]), rolled)
        return full, jnp.concatenate([y1, y2, y3], 1), y4

    full, pieces, after = run(layer, x)
    np.testing.assert_allclose(pieces, full, atol=1e-5)
    np.testing.assert_allclose(after[0], full[0, 13:17], atol=1e-5)
    np.testing.assert_allclose(after[1], full[1, 11:15], atol=1e-5)


def test_cache_holds_max_len_slots():
    state = jax.eval_shape(lambda: make(order=3).init_state(2, 40))
    assert state.inputs.shape == state.filter.shape == (2, 3, 40, D) and state.doc.shape == (2, 40)


@pytest.mark.parametrize("kwargs, message", [({"filter_emb_dim": 4}, "filter_emb_dim=4"), ({"order": 0}, "order=0"),
                                             ({"impl": "pallas"}, "impl='pallas'"), ({"decay_target": 2.0}, "decay")])
def test_constructor_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: Hyena(D, rngs=nnx.Rngs(0), **kwargs))
