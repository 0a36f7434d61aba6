"""Titans' linear memory op: the chunk form against the token-by-token reference (outputs, final state,
gradients w.r.t. every input and the initial state; T = 1 and T not a multiple of the mini-batch, packed
documents, a state that stops mid-mini-batch, a call split mid-mini-batch); the first two mini-batches against
an independent numpy loop of the paper's equations (float64); argument errors. The deep (two-layer MLP) memory:
its chunk form against its reference (the same checks in one test), its first two mini-batches against jax.grad of
the loss, and the layer with memory_depth 2 through the mixer protocol."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.titans import titans
from tests.util import assert_close

C = 4  # the mini-batch size of these tests


def inputs(B, T, H, K, V, seed=0):
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    q, k, v = n(B, T, H, K), 0.5 * n(B, T, H, K), n(B, T, H, V)
    theta = 0.3 / (1 + np.exp(-n(B, T, H)))
    log_eta, log_decay = -np.log1p(np.exp(-n(B, T, H) - 1)), -np.log1p(np.exp(-n(B, T, H) - 2))  # log-sigmoids
    W0 = 0.5 * n(H, K, V)
    state = (W0 + 0.1 * n(B, H, K, V), W0 + 0.2 * n(B, H, K, V), 0.1 * n(B, H, K, V),
             np.asarray([1, 3][:B], np.int32))  # stopped mid-mini-batch: 1 and 3 tokens in
    return [jnp.asarray(x) for x in (q, k, v, theta, log_eta, log_decay, W0)], tuple(map(jnp.asarray, state))


@functools.partial(jax.jit, static_argnames="mode")
def outputs_and_grads(args, state, segment_ids, *, mode):
    def loss(args, floats):
        o, S = titans(*args, mini_batch_size=C, initial_state=(*floats, state[3]), segment_ids=segment_ids,
                      output_final_state=True, mode=mode)
        return jnp.sum(o * jnp.cos(o)) + sum(jnp.sum(s * jnp.sin(s)) for s in S[:3]), (o, *S)
    return jax.grad(loss, argnums=(0, 1), has_aux=True)(args, state[:3])


@pytest.mark.parametrize("T, packed", [(19, True), (1, False)])
def test_chunk_form_matches_reference(T, packed):
    args, state = inputs(2, T, 2, 4, 3)
    ids = jnp.asarray([[0] * 2 + [1] * 9 + [2] * 8, [0] * 6 + [1] * 13], jnp.int32)[:, :T] if packed else None
    want_grads, want = outputs_and_grads(args, state, ids, mode="recurrent")
    grads, got = outputs_and_grads(args, state, ids, mode="chunk")
    for name, a, b in zip(("o", "W", "M", "S", "pos"), got, want):
        if name == "pos":
            np.testing.assert_array_equal(a, b)
        else:
            assert_close(a, b, what=f"chunk {name}")
    names = "q k v theta log_eta log_decay W0".split() + ["initial " + s for s in ("W", "M", "S")]
    for name, a, b in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert_close(a, b, 1e-3, what=f"chunk d{name}")


def test_a_call_split_mid_mini_batch_continues():
    args, state = inputs(2, 13, 2, 4, 4, seed=1)
    run = jax.jit(lambda args, state, mode: titans(*args, mini_batch_size=C, initial_state=state,
                                                   output_final_state=True, mode=mode), static_argnums=2)
    o, S = run(args, state, "recurrent")
    cut = lambda lo, hi: [a[:, lo:hi] for a in args[:6]] + args[6:]
    o1, S1 = run(cut(0, 6), state, "chunk")
    o2, S2 = run(cut(6, 13), S1, "chunk")
    assert_close(jnp.concatenate([o1, o2], axis=1), o, what="two calls vs one")
    for a, b in zip(S2, S):
        assert_close(a, b, what="state after two calls")


def test_two_mini_batches_match_a_numpy_loop():
    T = 2 * C
    args, _ = inputs(1, T, 2, 3, 4, seed=2)
    q, k, v, theta, log_eta, log_decay, W0 = (np.asarray(a, np.float64) for a in args)
    eta, keep = np.exp(log_eta), np.exp(log_decay)
    want = np.zeros(v.shape[1:])
    for h in range(q.shape[2]):
        M, S = W0[h].copy(), np.zeros_like(W0[h])
        for b in range(T // C):
            anchor = M.copy()  # the paper's M_{t'}: every gradient of the mini-batch is taken here
            for t in range(b * C, (b + 1) * C):
                grad = 2 * np.outer(k[0, t, h], k[0, t, h] @ anchor - v[0, t, h])  # d/dM ||k M - v||^2
                S = eta[0, t, h] * S - theta[0, t, h] * grad
                M = keep[0, t, h] * M + S
                want[t, h] = q[0, t, h] @ M
    for mode in ("chunk", "recurrent"):
        o, _ = jax.jit(functools.partial(titans, mini_batch_size=C, mode=mode))(*args)
        assert_close(o[0], want, what=f"{mode} vs numpy")


def test_bad_arguments():
    args, _ = inputs(1, 3, 1, 4, 4)
    with pytest.raises(ValueError, match="mode='parallel'"):
        titans(*args, mini_batch_size=C, mode="parallel")
    with pytest.raises(ValueError, match="impl='pallas'"):
        titans(*args, mini_batch_size=C, impl="pallas")
    with pytest.raises(ValueError, match="chunk_size=0"):
        titans(*args, mini_batch_size=0)


def test_deep_memory_chunk_form_matches_reference():
    """memory_depth 2: outputs, final state and gradients of the chunk form against the reference (packed, T = 19
    from a state stopped mid-mini-batch); a call from the learned start split mid-mini-batch into calls of 6, 1
    and 6 tokens; the reference's first two mini-batches against jax.grad of ||M(k) - v||^2."""
    (q, k, v, theta, log_eta, log_decay, _), _ = inputs(2, 19, 2, 4, 4)
    r = np.random.RandomState(3)
    W0 = tuple(jnp.asarray(0.5 * r.standard_normal(s), jnp.float32) for s in ((2, 4, 8), (2, 8, 4)))
    pair = lambda s: tuple(w + s * jnp.asarray(r.standard_normal((2, *w.shape)), jnp.float32) for w in W0)
    floats = (pair(0.1), pair(0.2), tuple(0.1 * (p - w) for p, w in zip(pair(1.0), W0)))
    args = [q, k, v, theta, log_eta, log_decay, W0]
    ids = jnp.asarray([[0] * 2 + [1] * 9 + [2] * 8, [0] * 6 + [1] * 13], jnp.int32)
    pos = jnp.asarray([1, 3], jnp.int32)

    @functools.partial(jax.jit, static_argnames="mode")
    def run(args, floats, *, mode):
        def loss(args, floats):
            o, S = titans(*args, mini_batch_size=C, initial_state=(*floats, pos), segment_ids=ids,
                          output_final_state=True, mode=mode)
            return jnp.sum(o * jnp.cos(o)) + sum(jnp.sum(s * jnp.sin(s)) for s in jax.tree.leaves(S[:3])), (o, S)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(args, floats)

    want_grads, want = run(args, floats, mode="recurrent")
    grads, got = run(args, floats, mode="chunk")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert_close(a, b, what=f"chunk output/state {i}")
    for i, (a, b) in enumerate(zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))):
        assert_close(a, b, 1e-3, what=f"chunk gradient {i}")

    call = jax.jit(lambda args, S, mode: titans(*args, mini_batch_size=C, initial_state=S, output_final_state=True,
                                                mode=mode), static_argnums=2)
    cut = lambda lo, hi: [a[:, lo:hi] for a in args[:6]] + args[6:]
    o, S = call(cut(0, 13), None, "recurrent")
    outs, S_split = [], None
    for lo, hi in ((0, 6), (6, 7), (7, 13)):  # T = 1 in the middle
        o_part, S_split = call(cut(lo, hi), S_split, "chunk")
        outs.append(o_part)
    assert_close(jnp.concatenate(outs, axis=1), o, what="three calls vs one")
    for a, b in zip(jax.tree.leaves(S_split), jax.tree.leaves(S)):
        assert_close(a, b, what="state after three calls")

    @jax.jit
    def by_autodiff(q, k, v, theta, log_eta, log_decay):  # row 0, two mini-batches, the paper's equations
        memory = lambda Ws, x: jax.nn.gelu(x @ Ws[0], approximate=False) @ Ws[1]
        out = []
        for h in range(q.shape[2]):
            M, S = (W0[0][h], W0[1][h]), (0.0, 0.0)
            for b in range(2):
                anchor = M
                for t in range(b * C, (b + 1) * C):
                    u = jax.grad(lambda Ws: jnp.sum((memory(Ws, k[0, t, h]) - v[0, t, h]) ** 2))(anchor)
                    S = tuple(jnp.exp(log_eta[0, t, h]) * s - theta[0, t, h] * g for s, g in zip(S, u))
                    M = tuple(jnp.exp(log_decay[0, t, h]) * m + s for m, s in zip(M, S))
                    out.append(memory(M, q[0, t, h]))
        return jnp.stack(out).reshape(q.shape[2], 2 * C, -1).swapaxes(0, 1)  # (2C, H, V)
    assert_close(o[0, :2 * C], by_autodiff(*cut(0, 2 * C)[:6]), what="reference vs jax.grad")

