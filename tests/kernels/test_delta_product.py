"""Gated DeltaProduct's op (kernels/delta_rule/product.py): the interleaved delta rule against a loop
over the paper's equations, and every mode against the reference, gradients included."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule.product import delta_product
from tests.util import assert_close, assert_tree_close

ARGS = ("q", "k", "v", "beta", "g", "initial_state")


def make_inputs(seed, B, T, n, H, K, V):
    r = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    x = dict(q=unit(r.standard_normal((B, T, H, K))), k=unit(r.standard_normal((B, T, n, H, K))),
             v=r.standard_normal((B, T, n, H, V)),
             beta=2 / (1 + np.exp(-r.standard_normal((B, T, n, H)))),  # in (0, 2): negative eigenvalues allowed
             g=-np.logaddexp(0, -(2 * r.standard_normal((B, T, H)) + 2)), initial_state=r.standard_normal((B, H, K, V)))
    return {a: jnp.asarray(x[a], jnp.float32) for a in ARGS}


@pytest.mark.parametrize("T", [1, 5])
def test_matches_explicit_loop(T):
    """S_{t,0} = alpha_t S_{t-1}; S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T;
    o_t = scale S_{t,n}^T q_t; a document starts at t = 2."""
    n, K, V = 3, 4, 3
    x = make_inputs(0, 1, T, n, 1, K, V)
    seg = jnp.asarray((np.arange(T) >= 2)[None], jnp.int32)
    o, S = jax.jit(partial(delta_product, scale=0.5, segment_ids=seg, output_final_state=True, impl="reference"))(**x)
    q, k, v, beta, g = (np.asarray(x[a], np.float64)[0] for a in ARGS[:5])
    state = np.asarray(x["initial_state"], np.float64)[0, 0]
    outs = []
    for t in range(T):
        if t == 2:
            state = np.zeros_like(state)
        state = np.exp(g[t, 0]) * state
        for j in range(n):
            kj = k[t, j, 0]
            state = (np.eye(K) - beta[t, j, 0] * np.outer(kj, kj)) @ state + beta[t, j, 0] * np.outer(kj, v[t, j, 0])
        outs.append(0.5 * state.T @ q[t, 0])
    assert_close(np.asarray(o)[0, :, 0], np.stack(outs), 1e-5, "o")
    assert_close(np.asarray(S)[0, 0], state, 1e-5, "S")


@partial(jax.jit, static_argnames=("mode", "impl"))
def outputs_and_grads(x, do, dS, seg, mode, impl):
    def loss(x):
        o, S = delta_product(**x, segment_ids=seg, output_final_state=True, mode=mode, chunk_size=8, impl=impl)
        return jnp.sum(o * do) + jnp.sum(S * dS), (o, S)
    grads, (o, S) = jax.grad(loss, has_aux=True)(x)
    return o, S, grads


@pytest.mark.parametrize("T", [1, 13])  # 13 tokens x 3 sub-steps = 39: ragged chunks of 8
def test_modes_match_reference(T):
    B, n, H, K, V = 2, 3, 2, 8, 4
    x = make_inputs(1, B, T, n, H, K, V)
    r = np.random.default_rng(2)
    do, dS = jnp.asarray(r.standard_normal((B, T, H, V))), jnp.asarray(r.standard_normal((B, H, K, V)))
    seg = jnp.asarray(np.stack([np.arange(T) >= T // 2, np.zeros(T)]), jnp.int32)
    o_ref, S_ref, g_ref = outputs_and_grads(x, do, dS, seg, "recurrent", "reference")
    for mode in ("chunk", "parallel"):
        o, S, grads = outputs_and_grads(x, do, dS, seg, mode, "xla")
        assert_close(o, o_ref, 1e-4, f"{mode} o")
        assert_close(S, S_ref, 1e-4, f"{mode} S")
        assert_tree_close(grads, g_ref, 1e-4, f"{mode} grad")
