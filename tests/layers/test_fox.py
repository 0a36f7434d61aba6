"""ForgettingAttention (layers/fox.py): what the registry's conformance run (GQA, the Pro block's parts
on) leaves out: MHA with a rotary through the mixer protocol, the layer against FoX's equation looped
over its own projections and gate, and constructor errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.fox import ForgettingAttention
from layers.linear import project
from tests.kernels.test_attention_decay import fox_loop
from tests.layers.conformance import check_mixer, perturbed
from tests.util import assert_close

D = 16


def test_protocol_with_a_rotary():
    check_mixer(lambda **kw: ForgettingAttention(D, num_heads=2, rope_base=100.0, rngs=nnx.Rngs(0), **kw), D)


def test_matches_the_papers_equation():
    """y = concat_h(o) W_O with o from FoX's loop over the layer's q, k, v and log f = log sigmoid(x w_f + b_f),
    packed documents included."""
    layer = perturbed(ForgettingAttention(D, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(1)))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 9, D)), jnp.float32)
    seg = np.array([[0] * 4 + [1] * 5, [3] * 9], np.int32)
    q, k, v = (project(x, w[...]) for w in (layer.wq, layer.wk, layer.wv))
    log_f = np.asarray(jax.nn.log_sigmoid(project(x, layer.wf[...]) + layer.bf[...]))
    o = fox_loop(q, k, v, log_f, seg)  # (B, T, H, K)
    want = np.einsum("bthk,hkd->btd", o, np.asarray(layer.wo[...]))
    assert_close(layer(x, segment_ids=jnp.asarray(seg)), want, 1e-5, "FoX layer")


def test_constructor_errors():
    for kwargs, msg in [(dict(num_heads=3), "num_heads=3 does not divide d_model=16"),
                        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads=3 does not divide num_heads=4"),
                        (dict(impl="triton"), "impl='triton'")]:
        with pytest.raises(ValueError, match=msg):
            ForgettingAttention(D, rngs=nnx.Rngs(0), **kwargs)
