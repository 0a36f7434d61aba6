"""Mamba layer: what is specific to it (the protocol runs in test_conformance.py): the variant
without a convolution, nothing leaking across a document start, the state's shapes, the paper's
initialisation, constructor checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels import MODES
from layers.mamba import Mamba, MambaState
from tests.layers.conformance import check_mixer

D, B, T = 16, 2, 20
make = lambda **kw: Mamba(D, state_size=4, chunk_size=8, rngs=nnx.Rngs(0), **kw)
# Two documents, A (9 tokens) and B (11), packed as the rows [A, B] and [B, A]; numpy data avoids
# jax.random compiles.
LEN_A = 9
_row = np.random.default_rng(0).standard_normal((T, D))
X = jnp.asarray(np.stack([_row, np.concatenate([_row[LEN_A:], _row[:LEN_A]])]), jnp.float32)  # (B, T, D)
SEG = jnp.asarray(np.stack([np.repeat([0, 1], [LEN_A, T - LEN_A]), np.repeat([5, 2], [T - LEN_A, LEN_A])]), jnp.int32)

forward = nnx.jit(lambda m, x, seg: m(x, segment_ids=seg))


def test_nothing_leaks_across_a_document_start():
    """Changing the first document, its last tokens above all (in the next one's conv window), leaves
    the second document's outputs unchanged (up to float rounding: chunked forms sum log-decays over a
    chunk that may hold both documents)."""
    layer = make()
    changed = X.at[0, :LEN_A].multiply(-3.0)
    a, b = forward(layer, X, SEG), forward(layer, changed, SEG)
    assert float(jnp.abs(a[0, :LEN_A] - b[0, :LEN_A]).max()) > 1e-3  # the change is visible where it should be
    np.testing.assert_allclose(a[0, LEN_A:], b[0, LEN_A:], atol=1e-6, rtol=0)


def test_state_shapes():
    small = make().init_state(B, 128)
    assert isinstance(small, MambaState)
    assert small.ssm.shape == (B, 2 * D, 4) and small.conv.shape == (B, 3, 2 * D)


def test_init_matches_the_paper():
    assert nnx.eval_shape(lambda: Mamba(33, rngs=nnx.Rngs(0))).dt_rank == 3  # ceil(33 / 16)
    layer = make()
    np.testing.assert_allclose(-jnp.exp(layer.A_log[...]), -np.tile(np.arange(1, 5), (2 * D, 1)), rtol=1e-6)
    dt = jax.nn.softplus(layer.dt_bias[...])
    assert float(dt.min()) >= 0.001 * 0.999 and float(dt.max()) <= 0.1 * 1.001
    np.testing.assert_array_equal(layer.D[...], 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="fused"), "mode"), (dict(conv_size=-1), "conv_size"), (dict(dt_rank=0), "dt_rank"),
    (dict(dt_min=0.2, dt_max=0.1), "dt_min"), (dict(chunk_size=0), "chunk_size"), (dict(state_size=0), "state_size"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Mamba(D, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("variant", [dict(conv_size=0), dict(inner_norms=True, norm_eps=1e-5)])
def test_variant(variant):
    check_mixer(lambda **kw: make(**variant, **kw), D, MODES)


def test_inner_norms_are_rms_norms_of_dt_b_and_c():
    """inner_norms (Jamba): Δ_low, B and C each pass an RMSNorm with its weight after x_proj; scaling x_proj's
    output for B and C by any factor then changes nothing, and a norm weight of 2 on C doubles the scan's C·h part."""
    layer = make(inner_norms=True, norm_eps=1e-12)  # eps ~ 0: the scale of B and C leaves nothing
    assert layer.dt_norm.weight.shape == (1,) and layer.b_norm.weight.shape == layer.c_norm.weight.shape == (4,)
    assert layer.c_norm.eps == 1e-12 and make().dt_norm is None
    x = X[:1, :6]
    y = layer(x)
    R = layer.dt_rank
    layer.x_proj.kernel[...] = layer.x_proj.kernel[...].at[:, R:].multiply(7.0)  # B, C scaled: normed away
    np.testing.assert_allclose(layer(x), y, atol=1e-5, rtol=1e-5)
    layer.D[...] = jnp.zeros_like(layer.D[...])
    no_skip = layer(x)
    layer.c_norm.weight[...] = 2 * layer.c_norm.weight[...]
    np.testing.assert_allclose(layer(x), 2 * no_skip, atol=1e-5, rtol=1e-5)
