"""Mamba2 layer: modes agree, prefill + steps == full pass, packed == alone (nothing leaks through the
conv window), constant state size, gradients reach every parameter, constructor checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.mamba2 import Mamba2, Mamba2State

D, B, T = 16, 2, 20
# Di = 32, H = 4 heads of P = 8, G = 2 groups of N = 8; chunk 8 does not divide T.
make = lambda **kw: Mamba2(D, **{"state_size": 8, "head_dim": 8, "num_groups": 2, "chunk_size": 8,
                                 "rngs": nnx.Rngs(0), **kw})
# Two documents, A (9 tokens) and B (11), packed as the rows [A, B] and [B, A]; numpy data avoids
# jax.random compiles.
LEN_A = 9
_row = np.random.default_rng(0).standard_normal((T, D))
X = jnp.asarray(np.stack([_row, np.concatenate([_row[LEN_A:], _row[:LEN_A]])]), jnp.float32)  # (B, T, D)
SEG = jnp.asarray(np.stack([np.repeat([0, 1], [LEN_A, T - LEN_A]), np.repeat([5, 2], [T - LEN_A, LEN_A])]), jnp.int32)
ONE_DOC = jnp.zeros_like(SEG)  # "no segment_ids" that shares the compiled forward with SEG

forward = nnx.jit(lambda m, x, seg: m(x, segment_ids=seg))
decode = nnx.jit(lambda m, x, state, seg: m.decode(x, state, segment_ids=seg))


def test_modes_agree():
    want = forward(make(), X, SEG)  # the default mode, "chunk"; its compile is shared with other tests
    assert want.shape == (B, T, D) and want.dtype == jnp.float32
    for mode in ("recurrent", "parallel"):
        np.testing.assert_allclose(forward(make(mode=mode), X, SEG), want, atol=1e-5, rtol=0, err_msg=mode)


@pytest.mark.parametrize("kwargs", [{}, {"conv_size": 0, "num_groups": 4}], ids=["conv4_G2", "noconv_G4"])
def test_prefill_then_steps_equals_full_pass(kwargs):
    layer = make(**kwargs)
    full = forward(layer, X, ONE_DOC)
    y, state = decode(layer, X[:, :11], layer.init_state(B, 64), None)
    ys = [y]
    for t in range(11, T):
        y, state = decode(layer, X[:, t:t + 1], state, None)
        ys.append(y)
    assert float(jnp.abs(jnp.concatenate(ys, axis=1) - full).max()) <= 1e-4
    assert float(jnp.abs(full).max()) > 1e-3  # not vacuous


def test_packed_equals_documents_alone():
    layer = make()
    alone = forward(layer, X, ONE_DOC)  # row 0 starts with A alone, row 1 with B alone
    la, lb = LEN_A, T - LEN_A
    for packed in (forward(layer, X, SEG), decode(layer, X, layer.init_state(B, 64), SEG)[0]):
        for got, want in [(packed[0, :la], alone[0, :la]), (packed[0, la:], alone[1, :lb]),
                          (packed[1, :lb], alone[1, :lb]), (packed[1, lb:], alone[0, :la])]:
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_nothing_leaks_across_a_document_start():
    """Changing the first document, its last tokens above all (in the next one's conv window), leaves
    the second document's outputs unchanged (up to float rounding: chunked forms sum log-decays over a
    chunk that may hold both documents)."""
    layer = make()
    changed = X.at[0, :LEN_A].multiply(-3.0)
    a, b = forward(layer, X, SEG), forward(layer, changed, SEG)
    assert float(jnp.abs(a[0, :LEN_A] - b[0, :LEN_A]).max()) > 1e-3  # the change is visible where it should be
    np.testing.assert_allclose(a[0, LEN_A:], b[0, LEN_A:], atol=1e-6, rtol=0)


def test_state_size_independent_of_max_len():
    layer = make()
    nbytes = lambda s: sum(leaf.nbytes for leaf in jax.tree.leaves(s))
    small, large = layer.init_state(B, 128), layer.init_state(B, 16384)
    assert isinstance(small, Mamba2State) and nbytes(small) == nbytes(large) > 0
    assert small.ssm.shape == (B, 4, 8, 8) and small.conv.shape == (B, 3, 2 * D + 2 * 2 * 8)


def test_gradients_reach_every_parameter():
    layer = make()
    target = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X, segment_ids=SEG) * target)))(layer)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    assert len(leaves) == 8  # in_proj, conv weight + bias, dt_bias, A_log, D, norm, out_proj
    for path, g in leaves:
        assert bool(jnp.all(jnp.isfinite(g))), jax.tree_util.keystr(path)
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_bfloat16_compute_keeps_float32_params():
    layer = make(dtype=jnp.bfloat16)
    y, state = nnx.eval_shape(lambda m: m.decode(X, m.init_state(B, 64), segment_ids=SEG), layer)  # no compile
    assert y.dtype == jnp.bfloat16 and state.ssm.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def test_init_matches_the_official_module():
    layer = make()
    A = jnp.exp(layer.A_log[...])
    assert float(A.min()) >= 1.0 and float(A.max()) <= 16.0
    dt = jax.nn.softplus(layer.dt_bias[...])
    assert float(dt.min()) >= 0.001 * 0.999 and float(dt.max()) <= 0.1 * 1.001
    np.testing.assert_array_equal(layer.D[...], 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_dim=5), "head_dim=5 does not divide"), (dict(num_groups=3), "num_groups=3 does not divide"),
    (dict(mode="auto"), "mode"), (dict(conv_size=-1), "conv_size"), (dict(A_init_range=(0.0, 1.0)), "A_init_range"),
    (dict(dt_min=0.2, dt_max=0.1), "dt_min"), (dict(chunk_size=0), "chunk_size"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)
