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
    assert gqa.init_state(2, 16).k.shape == (2, 16, G, D // H)  # the cache holds only kv heads


def test_cache_overflow_is_an_error():
    layer = Attention(16, num_heads=2, rngs=nnx.Rngs(0))
    state = layer.init_state(1, 4)
    _, state = layer.decode(randn(0, (1, 3, 16)), state)
    with pytest.raises(ValueError, match="max_len=4"):
        layer.decode(randn(0, (1, 2, 16)), state)


def test_bad_heads():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(32, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))
