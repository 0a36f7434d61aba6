"""RWKV-7: what is specific to it (the protocol, with layer 1's value residual, runs in
test_conformance.py): layer 0 has no value-residual parameters and a later layer needs v_first; the
channel mix's width; constructor errors."""

import jax.numpy as jnp
import pytest
from flax import nnx

from layers.rwkv7 import RWKV7ChannelMix, RWKV7TimeMix
from tests.layers.conformance import randn

D, HEAD = 32, 16


def test_value_residual_and_constructor_errors():
    first, second = (RWKV7TimeMix(D, head_dim=HEAD, layer_id=i, num_layers=2, rngs=nnx.Rngs(0)) for i in (0, 1))
    assert RWKV7TimeMix.carries_v_first
    assert not hasattr(first, "vres_a") and hasattr(second, "vres_a")
    with pytest.raises(ValueError, match="v_first"):
        second(jnp.asarray(randn(1, (1, 5, D))))
    assert RWKV7ChannelMix(D, rngs=nnx.Rngs(0)).w_k.shape == (D, 4 * D)
    for bad in (dict(head_dim=12), dict(mode="fused"), dict(layer_id=3, num_layers=3), dict(gate_lora_dim=0)):
        with pytest.raises(ValueError):
            RWKV7TimeMix(D, **{"head_dim": HEAD, **bad}, rngs=nnx.Rngs(0))
