"""LinearAttention layer: every feature map, normaliser on and off, through the mixer protocol
(tests/layers/conformance.py), each map against its paper's formula, Performer's feature redraw, and
constructor errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels import MODES
from layers.linear_attention import LinearAttention
from tests.layers.conformance import check_mixer
from tests.util import assert_close

D = 16


def randn(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


# The registry's run (test_conformance.py) covers elu; the elementwise maps (identity, elu, relu)
# share all the machinery with the others, so the protocol runs on identity (with the normaliser
# off; the others have it on) and test_feature_maps checks every map's formula. Taylor runs with
# q and k narrower than the head (Based's small feature_dim).
CONFIGS = [("identity", False, None), ("performer", True, None), ("cosformer", True, None), ("hedgehog", True, None),
           ("taylor", True, 3)]


@pytest.mark.parametrize("feature_map,normalize,qk_dim", CONFIGS)
def test_protocol(feature_map, normalize, qk_dim):
    check_mixer(lambda **kw: LinearAttention(D, num_heads=2, feature_map=feature_map, normalize=normalize,
                                             qk_dim=qk_dim, chunk_size=8, cosformer_max_len=32, rngs=nnx.Rngs(0),
                                             **kw),
                D, MODES)


def test_feature_maps():
    """Each phi against its paper's formula, on (1, 6, 2, 8) inputs."""
    x, y = np.asarray(randn(1, (1, 6, 2, 8))), np.asarray(randn(2, (1, 6, 2, 8)))
    pos = jnp.arange(6, dtype=jnp.int32)[None]
    make = lambda fm, **kw: LinearAttention(D, num_heads=2, feature_map=fm, normalize=fm != "identity",
                                            rngs=nnx.Rngs(0), **kw)
    phi = lambda layer, a, is_query=False: np.asarray(layer._phi(jnp.asarray(a), pos, is_query), np.float64)
    assert_close(phi(make("identity"), x), x, what="identity")
    assert_close(phi(make("elu"), x), np.where(x > 0, x + 1, np.exp(x)), what="elu + 1")
    assert_close(phi(make("relu"), x), np.maximum(x, 0), what="relu")
    # cosFormer: phi(q_i) . phi(k_j) = relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M)
    cos_layer = make("cosformer", cosformer_max_len=10)
    got = np.einsum("bihf,bjhf->bhij", phi(cos_layer, x, True), phi(cos_layer, y))
    i = np.arange(6)
    want = np.einsum("bihk,bjhk->bhij", np.maximum(x, 0), np.maximum(y, 0)) * np.cos(np.pi / 20 * (i[:, None] - i))
    assert_close(got, want, what="cosformer re-weighting")
    # Hedgehog at initialisation (identity map): softmax over [x, -x].
    e = np.exp(np.concatenate([x, -x], -1))
    assert_close(phi(make("hedgehog"), x, True), e / e.sum(-1, keepdims=True), what="hedgehog")
    # Performer: phi(q) . phi(k) is an unbiased estimate of exp(q . k / sqrt(K)); 4096 features, small
    # inputs. (Orthogonal directions straight from QR, without the sign fix, miss by ~4% on average.)
    perf = make("performer", num_features=4096)
    a, b = 0.3 * x, 0.3 * y
    got = np.einsum("bihf,bjhf->bhij", phi(perf, a, False), phi(perf, b, False))
    ratio = got / np.exp(np.einsum("bihk,bjhk->bhij", a, b) / np.sqrt(8))
    assert np.abs(ratio - 1).mean() < 0.02 and np.abs(ratio - 1).max() < 0.1, ratio
    # Based's Taylor map: phi = [1, x', x' ⊗ x' / sqrt(2)], x' = x d^-1/4, in full (the paper's d^2
    # entries) has the dot products 1 + s + s^2 / 2, s = q . k / sqrt(d); the layer's symmetric half
    # gives the same ones with 1 + d + d (d + 1) / 2 features.
    taylor = make("taylor")
    got_q, got_k = phi(taylor, x, True), phi(taylor, y)
    assert got_q.shape[-1] == 1 + 8 + 36 == taylor.feature_dim
    full = lambda a: np.concatenate([np.ones_like(a[..., :1]), a * 8 ** -0.25,
                                     (a[..., :, None] * a[..., None, :]).reshape(*a.shape[:-1], 64)
                                     / (np.sqrt(2) * np.sqrt(8))], axis=-1)
    s = np.einsum("bihk,bjhk->bhij", x, y) / np.sqrt(8)
    for a, b, what in [(got_q, got_k, "taylor (symmetric half)"), (full(x), full(y), "taylor (the paper's map)")]:
        assert_close(np.einsum("bihf,bjhf->bhij", a, b), 1 + s + s ** 2 / 2, what=what)


def test_redraw_features():
    layer = LinearAttention(D, num_heads=2, feature_map="performer", rngs=nnx.Rngs(0))
    before = np.asarray(layer.features[...])
    layer.redraw_features(jax.random.key(1))
    after = np.asarray(layer.features[...])
    assert after.shape == before.shape and not np.allclose(after, before)
    assert "features" not in nnx.state(layer, nnx.Param)  # not trained
    with pytest.raises(ValueError, match="performer"):
        LinearAttention(D, num_heads=2, rngs=nnx.Rngs(0)).redraw_features(jax.random.key(1))


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 does not divide d_model=16"),
                        (dict(feature_map="softmax"), "feature_map='softmax'"),
                        (dict(feature_map="identity"), "normalize=False"),
                        (dict(qk_dim=0), "qk_dim=0"),
                        (dict(mode="fused"), "mode='fused'")]:
        with pytest.raises(ValueError, match=msg):
            LinearAttention(D, rngs=nnx.Rngs(0), **kwargs)
