"""LinearAttention layer: every feature map, normaliser on and off, against the mixer protocol: the
three modes agree, prefill + token-by-token decode equals the full pass (with a document start inside
the prefill), a packed row equals its documents alone, the state does not grow with max_len, and
gradients reach every parameter. One jitted function per configuration keeps compiles few."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.linear_attention import LinearAttention
from tests.util import assert_close

# Compiles dominate these tests: skip XLA's backend optimisations (the same float32 math, about a
# third less CPU time).

B, T, D, P, CUT = 2, 20, 16, 12, 5  # batch, length, width, prefill length, document start in row 0
SEG = np.zeros((B, T), np.int32)
SEG[0, CUT:] = 1


def randn(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape), jnp.float32)


def protocol_outputs(layer, x, x_alone):
    """Everything the protocol checks, from one jitted function of the layer's state."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @functools.partial(jax.jit)
    def run(params, rest, x, x_alone):
        def model(mode="chunk"):
            m = nnx.merge(graphdef, params, rest)
            m.mode = mode
            return m

        out = {mode: model(mode)(x, segment_ids=SEG) for mode in ("recurrent", "chunk", "parallel")}
        m = model()
        y_prefill, state = m.decode(x[:, :P], m.init_state(B, 64), segment_ids=SEG[:, :P])

        def step(state, x_t):
            y_t, state = m.decode(x_t[:, None], state)
            return state, y_t[:, 0]

        _, y_steps = jax.lax.scan(step, state, jnp.swapaxes(x[:, P:], 0, 1))
        out["decode"] = jnp.concatenate([y_prefill, jnp.swapaxes(y_steps, 0, 1)], axis=1)
        out["alone"] = m(x_alone)
        weight = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

        def loss(params):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x, segment_ids=SEG) * weight)
        out["grads"] = jax.grad(loss)(params)
        return out

    return run(params, rest, x, x_alone)


def check_protocol(make, tol=1e-4):
    """make(**kwargs) builds the layer under test; kwargs is empty or sets dtype."""
    layer = make()
    x = randn(0, (B, T, D))
    # Row 0's two documents alone, as two batch rows; the first is zero-padded at the end (causal:
    # trailing padding cannot change earlier outputs).
    x_np = np.asarray(x)
    x_alone = jnp.asarray(np.stack([np.pad(x_np[0, :CUT], ((0, T - 2 * CUT), (0, 0))), x_np[0, CUT:]]))
    out = protocol_outputs(layer, x, x_alone)
    for mode in ("recurrent", "parallel"):
        assert_close(out[mode], out["chunk"], tol, f"mode {mode} vs chunk")
    decode_err = np.abs(np.asarray(out["decode"]) - np.asarray(out["chunk"])).max()
    assert decode_err <= tol, f"prefill + decode vs full pass: max abs diff {decode_err:.3g}"
    assert_close(out["chunk"][0, :CUT], out["alone"][0, :CUT], tol, "document 1 alone")
    assert_close(out["chunk"][0, CUT:], out["alone"][1], tol, "document 2 alone")
    for path, g in jax.tree_util.tree_leaves_with_path(out["grads"]):
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, f"gradient of {jax.tree_util.keystr(path)}"
    small, large = (jax.eval_shape(lambda n=n: layer.init_state(B, n)) for n in (128, 16384))
    nbytes = lambda s: sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(s))
    assert nbytes(small) == nbytes(large)
    # bfloat16 compute: float32 parameters and recurrent state, bfloat16 activations (shapes only).
    low = make(dtype=jnp.bfloat16)
    assert {p.dtype for p in jax.tree_util.tree_leaves(nnx.state(low, nnx.Param))} == {jnp.dtype(jnp.float32)}
    y, state = jax.eval_shape(lambda x: low.decode(x, low.init_state(B, 64)), x)
    assert y.dtype == jnp.bfloat16 and state.S.dtype == jnp.float32
    assert jax.eval_shape(lambda x: low(x, segment_ids=SEG), x).dtype == jnp.bfloat16


# The elementwise maps (identity, elu, relu) share all the machinery with the others, so the protocol
# runs on one of them (with the normaliser off; the other three have it on) and test_feature_maps
# checks every map's formula.
CONFIGS = [("identity", False), ("performer", True), ("cosformer", True), ("hedgehog", True)]


@pytest.mark.parametrize("feature_map,normalize", CONFIGS)
def test_protocol(feature_map, normalize):
    check_protocol(lambda **kw: LinearAttention(D, num_heads=2, feature_map=feature_map, normalize=normalize,
                                                chunk_size=8, cosformer_max_len=32, rngs=nnx.Rngs(0), **kw))


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
                        (dict(mode="fused"), "mode='fused'")]:
        with pytest.raises(ValueError, match=msg):
            LinearAttention(D, rngs=nnx.Rngs(0), **kwargs)
