"""The delta-rule layers: what is specific to them (the protocol of each runs in test_conformance.py):
DeltaNet without a short convolution, with the output gate, beta = 1 and sum-normalised q, k; Gated
DeltaNet with grouped value heads; Gated DeltaProduct without its gate, conv and output gate;
constructor errors."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kernels import MODES
from layers.deltanet import DeltaNet, GatedDeltaNet, GatedDeltaProduct, KimiDeltaAttention
from tests.layers.conformance import B, T, check_mixer, randn
from tests.util import assert_close

D = 16


def test_deltanet_variant():
    make = lambda **kw: DeltaNet(D, num_heads=2, conv_size=0, use_output_gate=True, use_beta=False, qk_norm="sum",
                                 chunk_size=8, rngs=nnx.Rngs(0), **kw)
    check_mixer(make, D, MODES)
    state = jax.eval_shape(lambda: make().init_state(B, 128))
    assert state.conv_q is None and state.recurrent.shape == (B, 2, 8, 8)


def test_gated_deltanet_grouped_value_heads():
    """num_v_heads = 2 num_heads (the protocol with it runs in test_conformance.py) equals a Gated DeltaNet of
    num_v_heads query/key heads whose q, k projections and convolutions give value head j the query/key head
    j // 2 (transformers' repeat_interleave in Qwen3-Next)."""
    make = lambda heads, seed: GatedDeltaNet(D, num_heads=heads, num_v_heads=4, head_dim=4, expand_v=1.5,
                                             chunk_size=8, rngs=nnx.Rngs(seed))
    grouped, full = make(2, 0), make(4, 1)
    params = dict(nnx.to_flat_state(nnx.state(grouped, nnx.Param)))
    repeat = lambda w: jnp.repeat(w.reshape(*w.shape[:-1], 2, 4), 2, axis=-2).reshape(*w.shape[:-1], 16)  # (.., H*K)
    for path, v in nnx.to_flat_state(nnx.state(full, nnx.Param)):
        w = params[path][...]
        v.set_value(repeat(w) if path[0] in ("q_proj", "k_proj", "q_conv", "k_conv") else w)
    x = jnp.asarray(randn(0, (B, T, D)))
    assert grouped.init_state(B).recurrent.shape == (B, 4, 4, 6)
    assert_close(*nnx.jit(lambda a, b, x: (a(x), b(x)))(grouped, full, x))


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
    with pytest.raises(ValueError, match="num_v_heads=3 must be a positive multiple of num_heads=2"):
        GatedDeltaNet(16, num_heads=2, num_v_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_householder=0"):
        GatedDeltaProduct(16, num_householder=0, rngs=nnx.Rngs(0))


def test_kda_takes_the_pallas_kernels():
    """impl="pallas" reaches the delta-rule kernels with KDA's per-channel gate (their values are
    checked in tests/kernels/test_delta_rule_pallas*.py and, in a model, tests/zoo/test_impl.py)."""
    mixer = KimiDeltaAttention(D, num_heads=2, impl="pallas", rngs=nnx.Rngs(0))
    assert "pallas_call" in str(jax.make_jaxpr(lambda x: mixer(x))(jnp.zeros((B, 20, D))))


def test_kda_without_gate_bias_is_kda_with_a_zero_one():
    """gate_bias=False (transformers' Kimi Linear) has no output-gate bias: the function of a zero bias."""
    plain = KimiDeltaAttention(D, num_heads=2, gate_bias=False, chunk_size=8, rngs=nnx.Rngs(0))
    biased = KimiDeltaAttention(D, num_heads=2, chunk_size=8, rngs=nnx.Rngs(1))
    assert plain.g_up.bias is None
    params = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
    for path, v in nnx.to_flat_state(nnx.state(biased, nnx.Param)):
        v.set_value(params[path][...] if path in params else jnp.zeros(v.shape))
    x = jnp.asarray(randn(0, (B, T, D)))
    assert_close(*nnx.jit(lambda a, b, x: (a(x), b(x)))(plain, biased, x))
