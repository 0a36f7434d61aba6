"""Mixture of Memories op: the masked delta-rule form (every memory a block of heads of one delta-rule call,
beta and the log-decay zeroed where a token is not routed) in each mode against the token-by-token,
memory-by-memory reference: outputs, final states, gradients w.r.t. every input and the initial state, odd
T, packed documents; a memory no token is routed to keeps its state; argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mom import mom
from tests.util import assert_close

NAMES = "q k v beta g weights S0".split()


def inputs(B, T, E, H, K, V, top_k, seed=0):
    """E - 1 routed memories (top_k of them per token, never the second-to-last one) and a shared one."""
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(n(B, T, H, K)), unit(n(B, T, E, H, K)), n(B, T, E, H, V)
    beta, g = 1 / (1 + np.exp(-n(B, T, E, H))), -np.logaddexp(0, -(n(B, T, E, H) + 2))
    scores = n(B, T, E - 1)
    scores[..., -1] = -np.inf  # memory E - 2: routed nowhere
    chosen = np.argsort(-scores, axis=-1)[..., :top_k]
    routed = np.zeros((B, T, E), bool)
    np.put_along_axis(routed, chosen, True, axis=-1)
    routed[..., -1] = True  # the shared memory
    weights = np.where(routed, np.abs(n(B, T, E)) + 0.1, 0).astype(np.float32)
    S0 = n(B, E, H, K, V) / 2
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, beta, g)] + [jnp.asarray(routed)] + \
        [jnp.asarray(x, jnp.float32) for x in (weights, S0)]


@functools.partial(jax.jit, static_argnames=("mode", "impl"))
def outputs_and_grads(q, k, v, beta, g, routed, weights, S0, segment_ids, *, mode, impl):
    def loss(q, k, v, beta, g, weights, S0):
        o, S = mom(q, k, v, beta, g, routed, weights, segment_ids=segment_ids, initial_state=S0,
                   output_final_state=True, mode=mode, chunk_size=8, impl=impl)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(S * jnp.sin(S)), (o, S)
    return jax.grad(loss, argnums=tuple(range(7)), has_aux=True)(q, k, v, beta, g, weights, S0)


@pytest.mark.parametrize("T, packed", [(19, True), (1, False)])
def test_masked_delta_rule_matches_reference(T, packed):
    q, k, v, beta, g, routed, weights, S0 = inputs(2, T, 5, 2, 4, 3, top_k=2)
    ids = jnp.asarray(np.sort(np.random.RandomState(1).randint(0, 3, (2, T)), axis=1)) if packed else None
    args = (q, k, v, beta, g, routed, weights, S0, ids)
    want_grads, (want_o, want_S) = outputs_and_grads(*args, mode="recurrent", impl="reference")
    if not packed:  # memory 3 is routed nowhere: it keeps its initial state (no document restarts it here)
        np.testing.assert_array_equal(np.asarray(want_S[:, 3]), np.asarray(S0[:, 3]))
    for mode in ("recurrent", "chunk", "parallel"):
        grads, (o, S) = outputs_and_grads(*args, mode=mode, impl="xla")
        assert_close(o, want_o, what=f"{mode} o")
        assert_close(S, want_S, what=f"{mode} final state")
        for name, a, b in zip(NAMES, grads, want_grads):
            assert_close(a, b, 1e-3, what=f"{mode} d{name}")


def test_bad_arguments():
    args = inputs(1, 3, 2, 1, 4, 3, top_k=1)[:7]
    with pytest.raises(ValueError, match="mode='fused'"):
        mom(*args, mode="fused")
    with pytest.raises(ValueError, match="impl='triton'"):
        mom(*args, impl="triton")
