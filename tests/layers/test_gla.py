"""GatedLinearAttention layer against the mixer protocol (modes agree, prefill + decode equals the full
pass, packed equals alone, fixed-size state, gradients reach every parameter; see
test_linear_attention.check_protocol), with and without the short convolution and the output gate."""

import jax
import pytest
from flax import nnx

from layers.gla import GatedLinearAttention
from tests.layers.test_linear_attention import B, D, check_protocol


@pytest.mark.parametrize("conv_size,use_output_gate", [(0, True), (4, False)])
def test_protocol(conv_size, use_output_gate):
    make = lambda **kw: GatedLinearAttention(D, num_heads=2, conv_size=conv_size, use_output_gate=use_output_gate,
                                             chunk_size=8, rngs=nnx.Rngs(0), **kw)
    check_protocol(make)
    state = jax.eval_shape(lambda: make().init_state(B, 128))
    assert (state.conv_q is None) == (conv_size == 0)


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 must divide"),
                        (dict(conv_size=-1), "conv_size=-1"),
                        (dict(gate_low_rank_dim=0), "gate_low_rank_dim=0"),
                        (dict(mode="fused_chunk"), "mode='fused_chunk'")]:
        with pytest.raises(ValueError, match=msg):
            GatedLinearAttention(D, rngs=nnx.Rngs(0), **kwargs)
