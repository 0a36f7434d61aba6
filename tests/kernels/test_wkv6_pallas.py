"""WKV6 through the GLA Pallas kernels (interpret mode on CPU) against the token-by-token reference:
outputs, final state and gradients w.r.t. every input, with packed documents and an initial state."""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels.wkv6 import wkv6
from tests.kernels.test_wkv6 import make_inputs
from tests.util import assert_close, assert_tree_close


@functools.partial(jax.jit, static_argnames=("impl",))
def value_and_grads(inputs, segment_ids, cotangents, impl):
    def loss(x):
        o, s = wkv6(**x, segment_ids=segment_ids, output_final_state=True, impl=impl)
        return jnp.sum(o * cotangents[0]) + jnp.sum(s * cotangents[1]), (o, s)
    (_, (o, s)), g = jax.value_and_grad(loss, has_aux=True)(inputs)
    return o, s, g


@pytest.mark.parametrize("B, T, K, V, packed", [(2, 21, 16, 32, True), (1, 1, 8, 8, False)])
def test_pallas_matches_reference(B, T, K, V, packed):
    x = make_inputs(3, B, T, 2, K, V)
    seg = jnp.array([[0] * 5 + [1] * 9 + [2] * 7, [0] * 16 + [1] + [2] * 4])[:B, :T] if packed else None
    cot = (jax.random.normal(jax.random.key(1), x["v"].shape),
           jax.random.normal(jax.random.key(2), x["initial_state"].shape))
    o, s, g = value_and_grads(x, seg, cot, "pallas")
    o_ref, s_ref, g_ref = value_and_grads(x, seg, cot, "reference")
    assert_close(o, o_ref, 1e-4, "o")
    assert_close(s, s_ref, 1e-4, "final state")
    assert_tree_close(g, g_ref, 1e-4, "grad ")
