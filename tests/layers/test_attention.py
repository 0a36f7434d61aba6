import jax.numpy as jnp
import pytest
from flax import nnx

from layers import Attention
from tests.util import assert_close, randn


@pytest.mark.parametrize("G", [1, 2])
def test_gqa_and_mqa_equal_mha_with_each_kv_head_repeated(G):
    H, D = 4, 32
    gqa = Attention(D, num_heads=H, num_kv_heads=G, rngs=nnx.Rngs(0))
    mha = Attention(D, num_heads=H, num_kv_heads=H, rngs=nnx.Rngs(1))
    mha.wq[...], mha.wo[...] = gqa.wq[...], gqa.wo[...]
    mha.wk[...] = jnp.repeat(gqa.wk[...], H // G, axis=1)
    mha.wv[...] = jnp.repeat(gqa.wv[...], H // G, axis=1)
    x = randn(2, (2, 9, D))
    assert_close(gqa(x), mha(x), 1e-5)
    assert gqa.init_state(2, 16).k.shape == (2, G, 16, D // H)  # the cache holds only kv heads, heads first


def test_cache_overflow_is_an_error():
    layer = Attention(16, num_heads=2, rngs=nnx.Rngs(0))
    state = layer.init_state(1, 4)
    _, state = layer.decode(randn(0, (1, 3, 16)), state)
    with pytest.raises(ValueError, match="max_len=4"):
        layer.decode(randn(0, (1, 2, 16)), state)


def test_bad_heads():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(32, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))


def test_past_the_trained_context_a_window_of_the_trained_length_or_every_token():
    """long_context="window": each query sees the last max_seq_len tokens, exactly a sliding window of
    that length (and full attention within it); "full": every earlier token."""
    x = randn(3, (1, 20, 32))
    make = lambda **kw: Attention(32, num_heads=4, rngs=nnx.Rngs(0), **kw)
    window, full = make(max_seq_len=8), make(max_seq_len=8, long_context="full")
    assert window.window == 8 and full.window is None and make(max_seq_len=8, window=4).window == 4
    assert_close(window(x), make(window=8)(x), 1e-6, "window vs a sliding window of 8")
    assert_close(window(x)[:, :8], full(x)[:, :8], 1e-6, "within the trained context")
    assert float(jnp.abs(window(x)[:, 8:] - full(x)[:, 8:]).max()) > 1e-3
    with pytest.raises(ValueError, match="long_context='none'"):
        make(long_context="none")
