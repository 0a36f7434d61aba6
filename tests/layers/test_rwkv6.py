"""RWKV-6 time mix and channel mix: modes agree, prefill + step decoding equals the full pass, packed
documents equal documents alone (token shift included), constant state size, gradients everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.rwkv6 import RWKV6ChannelMix, RWKV6TimeMix
from tests.util import assert_close

D, HEAD, B, T, PREFIX = 32, 16, 2, 12, 7


def randn(seed, shape, scale=1.0):
    """numpy, not jax.random (eager jax ops compile one kernel per shape: slow for tests)."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def perturbed(module, seed=0):
    """The module with noise on every parameter: the official init zeroes W_o and the first LoRA
    matrices, which would make the outputs, and most gradients, vanish and the tests vacuous."""
    params = nnx.state(module, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    noisy = [jnp.asarray(np.asarray(x) + randn(seed + i, x.shape, 0.2)) for i, x in enumerate(leaves)]
    nnx.update(module, jax.tree.unflatten(tree, noisy))
    return module


class Functions:
    """jitted pure functions of one module: call(params, x, seg) and decode(params, x, state)."""

    def __init__(self, module):
        graph, self.params = nnx.split(module)
        self.module = module
        self.call = jax.jit(lambda p, x, seg: nnx.merge(graph, p)(x, segment_ids=seg))
        self.decode = jax.jit(lambda p, x, st: nnx.merge(graph, p).decode(x, st))
        loss = lambda p, x, seg, c: jnp.sum(nnx.merge(graph, p)(x, segment_ids=seg) * c)
        self.grad = jax.jit(jax.grad(loss))


def check_layer(make, modes=()):
    """The layer conventions, for a factory make(mode) of identically initialised modules."""
    fns = Functions(perturbed(make(modes[0] if modes else None)))
    x = randn(1, (B, T, D))
    one_doc = np.zeros((B, T), np.int32)
    y = np.asarray(fns.call(fns.params, x, one_doc))
    assert y.shape == (B, T, D) and np.isfinite(y).all() and np.abs(y).max() > 1e-3

    for mode in modes[1:]:  # every mode computes the same function
        other = Functions(perturbed(make(mode)))
        assert_close(other.call(other.params, x, one_doc), y, 1e-4, f"mode {mode}")

    # prefill of PREFIX tokens, then one token at a time, equals the full pass
    state = fns.module.init_state(B, 64)
    y_pre, state = fns.decode(fns.params, x[:, :PREFIX], state)
    outs = [y_pre]
    for t in range(PREFIX, T):
        y_t, state = fns.decode(fns.params, x[:, t:t + 1], state)
        outs.append(y_t)
    assert np.abs(np.concatenate(outs, axis=1) - y).max() <= 1e-4

    # a packed row (two documents of T/2) equals the documents run alone, token shift included
    packed = np.array([[0] * (T // 2) + [1] * (T // 2), [3] * T], np.int32)
    y_packed = np.asarray(fns.call(fns.params, x, packed))
    y_alone = np.asarray(fns.call(fns.params, x[0].reshape(2, T // 2, D), np.zeros((2, T // 2), np.int32)))
    assert_close(y_packed[0], y_alone.reshape(T, D), 1e-5, "packed row")
    assert_close(y_packed[1], y[1], 1e-5, "unpacked row")
    assert not np.allclose(y_packed[0], y[0], atol=1e-3)  # the reset is real

    # the decoding state does not grow with max_len
    size = lambda n: sum(a.nbytes for a in jax.tree.leaves(fns.module.init_state(B, n)))
    assert size(128) == size(16384)

    # gradients are finite and reach every parameter
    grads = fns.grad(fns.params, x, packed, randn(2, (B, T, D)))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        assert np.isfinite(g).all(), jax.tree_util.keystr(path)
        assert np.abs(g).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_time_mix():
    check_layer(lambda mode: RWKV6TimeMix(D, head_dim=HEAD, layer_id=1, num_layers=3, mode=mode, chunk_size=8,
                                          rngs=nnx.Rngs(0)), modes=("chunk", "recurrent", "parallel"))


def test_channel_mix():
    check_layer(lambda _: RWKV6ChannelMix(D, layer_id=1, num_layers=3, rngs=nnx.Rngs(0)))


def test_bfloat16_and_constructor_errors():
    mix = perturbed(RWKV6TimeMix(D, head_dim=HEAD, chunk_size=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    y = Functions(mix).call(nnx.state(mix), randn(1, (1, 5, D)), None)
    assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    assert RWKV6ChannelMix(D, rngs=nnx.Rngs(0)).w_k.shape == (D, 96)  # 3.5 D rounded down to 32s
    for bad in (dict(head_dim=12), dict(mode="fused"), dict(layer_id=3, num_layers=3), dict(chunk_size=0)):
        with pytest.raises(ValueError):
            RWKV6TimeMix(D, **{"head_dim": HEAD, **bad}, rngs=nnx.Rngs(0))
