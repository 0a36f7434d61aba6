"""A cache's room under jit (issue 35): decoding more new tokens than a KV cache has slots is the same clear
ValueError inside a user's jitted decode as outside it (the sizes are static), and a cache that fills up under
jit, where the cached count is not known, flags it in `overflowed()` instead of crashing."""

import jax.numpy as jnp
import pytest
from flax import nnx

from zoo.registry import LAYER_OF, MIXERS, make_layer

D = 16
KINDS = [kind for kind, cfg in MIXERS.items() if LAYER_OF[cfg].grows_with_context]


def _layer(kind):
    return make_layer(MIXERS[kind](), D, rngs=nnx.Rngs(0))


def _cache(state):
    return state[0] if isinstance(state, tuple) else state  # MoBA and NSA: (KV cache, block table)


def test_every_layer_with_a_kv_cache_is_covered():
    assert {"attention", "fox", "mla", "moba", "nsa", "hyena"} <= set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_too_many_new_tokens_is_the_same_error_under_jit(kind):
    layer = _layer(kind)
    state, x = layer.init_state(1, 4), jnp.ones((1, 6, D))
    with pytest.raises(ValueError, match="6 new tokens exceed max_len=4"):
        layer.decode(x, state)
    with pytest.raises(ValueError, match="6 new tokens exceed max_len=4"):
        nnx.jit(lambda m, x, s: m.decode(x, s))(layer, x, state)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_that_fills_under_jit_flags_its_overflow(kind):
    layer = _layer(kind)
    _, state = layer.decode(jnp.ones((1, 3, D)), layer.init_state(1, 4))
    x = jnp.ones((1, 2, D))
    with pytest.raises(ValueError, match="3 cached \\+ 2 new tokens exceed max_len=4"):
        layer.decode(x, state)
    _, fits = nnx.jit(lambda m, x, s: m.decode(x, s))(layer, x[:, :1], state)
    assert not bool(_cache(fits).overflowed())
    _, full = nnx.jit(lambda m, x, s: m.decode(x, s))(layer, x, state)
    assert bool(_cache(full).overflowed())
