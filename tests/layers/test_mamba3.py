"""Mamba-3 layer, MIMO (the SISO kind runs the protocol in test_conformance.py): the mixer protocol with
mimo_rank 2; a MIMO layer whose second rank is switched off (zero input and output weights) is the SISO
layer with the first rank's weights; the MIMO parameters, state and constructor checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.mamba3 import Mamba3, Mamba3State
from tests.layers.conformance import check_mixer
from tests.util import assert_close

D = 32
# Di = 64, H = 4 heads of P = 16, G = 2 groups of N = 8, R = 2: every optional part on.
make = lambda **kw: Mamba3(D, **{"state_size": 8, "head_dim": 16, "num_groups": 2, "chunk_size": 8,
                                 "mimo_rank": 2, "rngs": nnx.Rngs(0), **kw})


def test_mimo_follows_the_mixer_protocol():
    """The layer's own mode, "chunk", against impl="reference" (mode "recurrent" is that same scan; "parallel"
    is the chunk form's other half, compared with the reference op by op in tests/kernels/test_mamba3.py)."""
    check_mixer(make, D)


def test_mimo_with_one_live_rank_is_siso():
    """R = 2 with rank 1's x and output weights 0 and rank 0's all 1 computes the SISO layer whose B, C
    columns, biases and other weights are rank 0's: the lift, the rank-R update and the mixing reduce to SISO's."""
    mimo, siso = make(), make(mimo_rank=1)
    Di, GN = mimo.d_inner, mimo.num_groups * mimo.state_size
    W = mimo.in_proj.kernel[...]  # columns [z, x, B (r g n), C (r g n), dt, A, λ, θ]
    siso.in_proj.kernel[...] = jnp.concatenate([W[:, :2 * Di + GN], W[:, 2 * Di + 2 * GN:2 * Di + 3 * GN],
                                                W[:, 2 * Di + 4 * GN:]], axis=1)
    for name in ("B_bias", "C_bias"):
        getattr(mimo, name)[...] = getattr(mimo, name)[...] + jnp.asarray(np.random.default_rng(0).normal(
            size=getattr(mimo, name).shape), jnp.float32)
        getattr(siso, name)[...] = getattr(mimo, name)[:, 0]
    on = jnp.asarray([1.0, 0.0])[None, :, None]  # (1, R, 1)
    mimo.mimo_x[...], mimo.mimo_o[...] = on * jnp.ones_like(mimo.mimo_x[...]), on * jnp.ones_like(mimo.mimo_o[...])
    mimo.mimo_z[...] = jnp.ones_like(mimo.mimo_z[...])
    for name in ("dt_bias", "D"):
        getattr(siso, name)[...] = getattr(mimo, name)[...]
    siso.out_proj.kernel[...] = mimo.out_proj.kernel[...]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 11, D)), jnp.float32)
    run = nnx.jit(lambda m, x: m(x))
    want = run(siso, x)
    assert np.abs(np.asarray(want)).max() > 1e-3
    assert_close(run(mimo, x), want, what="MIMO with one live rank vs SISO")


def test_mimo_parameters_and_state():
    layer = make()
    H, R, P, N = 4, 2, 16, 8
    assert layer.B_bias.shape == layer.C_bias.shape == (H, R, N)
    np.testing.assert_array_equal(layer.mimo_x[...], np.full((H, R, P), 1 / R))  # the official init
    np.testing.assert_array_equal(layer.mimo_z[...], np.ones((H, R, P)))
    np.testing.assert_array_equal(layer.mimo_o[...], np.full((H, R, P), 1 / R))
    assert layer.in_proj.kernel.shape == (D, 2 * 64 + 2 * R * 2 * N + 3 * H + 2)
    state = jax.eval_shape(lambda: layer.init_state(3, 100))
    assert isinstance(state, Mamba3State)
    assert (state.ssm.shape, state.angle.shape, state.b.shape, state.x.shape) == (
        (3, H, P, N), (3, H, N // 2), (3, H, R, N), (3, H, P))  # only B̄ grows with R
    siso = make(mimo_rank=1)
    assert not hasattr(siso, "mimo_x") and siso.B_bias.shape == (H, N)
    assert jax.eval_shape(lambda: siso.init_state(3)).b.shape == (3, H, N)


@pytest.mark.parametrize("bad", [0, -2])
def test_constructor_refuses_a_bad_rank(bad):
    with pytest.raises(ValueError, match=f"mimo_rank={bad}"):
        make(mimo_rank=bad)
