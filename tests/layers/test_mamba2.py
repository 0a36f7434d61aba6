"""Mamba-2 layer: what is specific to it (the protocol runs in test_conformance.py): the variant
without a convolution, with G = H groups and without output norm, nothing leaking across a document start, the state's
shapes, the official initialisation, constructor checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels import MODES
from layers.mamba2 import Mamba2, Mamba2State
from tests.layers.conformance import check_mixer

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
    assert isinstance(small, Mamba2State)
    assert small.ssm.shape == (B, 4, 8, 8) and small.conv.shape == (B, 3, 2 * D + 2 * 2 * 8)


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
    (dict(d_inner=20), "head_dim=8 does not divide the inner width d_inner = 20"),
    (dict(output_norm="rms"), "output_norm"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_variant():
    """No convolution, G = H groups, and no output norm (y * SiLU(z), Falcon-H1's mamba_rms_norm: false); the inner
    width of d_inner and the grouped norm run in test_conformance.py's parallel."""
    check_mixer(lambda **kw: make(conv_size=0, num_groups=4, output_norm="none", **kw), D, MODES)
