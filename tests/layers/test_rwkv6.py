"""RWKV-6: what is specific to it (the protocol runs in test_conformance.py): the channel mix's
width, bfloat16 compute, and constructor errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.rwkv6 import RWKV6ChannelMix, RWKV6TimeMix
from tests.layers.conformance import perturbed, randn

D, HEAD = 32, 16


def test_bfloat16_and_constructor_errors():
    mix = perturbed(RWKV6TimeMix(D, head_dim=HEAD, chunk_size=8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    y = nnx.jit(lambda m, x: m(x))(mix, jnp.asarray(randn(1, (1, 5, D))))
    assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    assert RWKV6ChannelMix(D, rngs=nnx.Rngs(0)).w_k.shape == (D, 96)  # 3.5 D rounded down to 32s
    for bad in (dict(head_dim=12), dict(mode="fused"), dict(layer_id=3, num_layers=3), dict(chunk_size=0)):
        with pytest.raises(ValueError):
            RWKV6TimeMix(D, **{"head_dim": HEAD, **bad}, rngs=nnx.Rngs(0))
