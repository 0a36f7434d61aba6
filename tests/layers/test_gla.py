"""GatedLinearAttention: what is specific to it (the protocol runs in test_conformance.py, with the
short convolution and the output gate): the variant without either, and constructor errors."""

import jax
import pytest
from flax import nnx

from kernels import MODES
from layers.gla import GatedLinearAttention
from tests.layers.conformance import B, check_mixer

D = 16


def test_without_convolution_and_output_gate():
    make = lambda **kw: GatedLinearAttention(D, num_heads=2, conv_size=0, use_output_gate=False, chunk_size=8,
                                             rngs=nnx.Rngs(0), **kw)
    check_mixer(make, D, MODES)
    assert jax.eval_shape(lambda: make().init_state(B, 128)).conv_q is None


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 must divide"),
                        (dict(conv_size=-1), "conv_size=-1"),
                        (dict(gate_low_rank_dim=0), "gate_low_rank_dim=0"),
                        (dict(mode="fused_chunk"), "mode='fused_chunk'")]:
        with pytest.raises(ValueError, match=msg):
            GatedLinearAttention(D, rngs=nnx.Rngs(0), **kwargs)
