"""The delta-rule layers: what is specific to them (the protocol of each runs in test_conformance.py):
DeltaNet without a short convolution, with the output gate, beta = 1 and sum-normalised q, k; Gated
DeltaProduct without its gate, conv and output gate; constructor errors."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kernels import MODES
from layers.deltanet import DeltaNet, GatedDeltaNet, GatedDeltaProduct, KimiDeltaAttention
from tests.layers.conformance import B, check_mixer

D = 16


def test_deltanet_variant():
    make = lambda **kw: DeltaNet(D, num_heads=2, conv_size=0, use_output_gate=True, use_beta=False, qk_norm="sum",
                                 chunk_size=8, rngs=nnx.Rngs(0), **kw)
    check_mixer(make, D, MODES)
    state = jax.eval_shape(lambda: make().init_state(B, 128))
    assert state.conv_q is None and state.recurrent.shape == (B, 2, 8, 8)


def test_deltaproduct_variant():
    make = lambda **kw: GatedDeltaProduct(D, num_heads=2, num_householder=2, conv_size=0, use_forget_gate=False,
                                          use_output_gate=False, chunk_size=8, rngs=nnx.Rngs(0), **kw)
    check_mixer(make, D, MODES)


def test_bad_shapes():
    with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=16"):
        DeltaNet(16, num_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(16, num_heads=2, head_dim=3, expand_v=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(16, mode="fused_recurrent", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qk_norm"):
        DeltaNet(16, qk_norm="l1", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_householder=0"):
        GatedDeltaProduct(16, num_householder=0, rngs=nnx.Rngs(0))


def test_kda_takes_the_pallas_kernels():
    """impl="pallas" reaches the delta-rule kernels with KDA's per-channel gate (their values are
    checked in tests/kernels/test_delta_rule_pallas*.py and, in a model, tests/zoo/test_impl.py)."""
    mixer = KimiDeltaAttention(D, num_heads=2, impl="pallas", rngs=nnx.Rngs(0))
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: mixer(x))(jnp.zeros((B, 20, D))))
