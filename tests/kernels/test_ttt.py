"""TTT-Linear op: the dual form against the token-by-token reference (outputs, final state, gradients w.r.t.
every input and the initial state; T = 1 and T not a multiple of the mini-batch, packed documents, a state
that stops mid-mini-batch, a call split where no mini-batch ends); the first mini-batch against an independent
numpy loop (the LayerNorm's Jacobian as a matrix, float64); argument errors. TTT-MLP: its dual form against its
reference (the same checks in one test), and the reference's first mini-batch against jax.grad of the loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.ttt import ttt_linear, ttt_mlp
from tests.util import assert_close

C = 4  # the mini-batch size of these tests


def inputs(B, T, H, K, seed=0):
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    q, k, v = n(B, T, H, K), n(B, T, H, K), n(B, T, H, K)
    eta = 0.5 / (1 + np.exp(-n(B, T, H)))
    W0, b0 = np.eye(K, dtype=np.float32) + 0.3 * n(H, K, K), 0.3 * n(H, K)
    ln_w, ln_b = 1 + 0.2 * n(H, K), 0.2 * n(H, K)
    scale = 1 / np.arange(1, C + 1, dtype=np.float32) + 0.1 * n(C)
    state = (W0 + 0.1 * n(B, H, K, K), b0 + 0.1 * n(B, H, K), 0.1 * n(B, H, K, K), 0.1 * n(B, H, K),
             np.asarray([1, 3][:B], np.int32))  # stopped mid-mini-batch: 1 and 3 tokens in
    return [jnp.asarray(x) for x in (q, k, v, eta, W0, b0, ln_w, ln_b, scale)], tuple(map(jnp.asarray, state))


@functools.partial(jax.jit, static_argnames="mode")
def outputs_and_grads(args, state, segment_ids, *, mode):
    def loss(args, floats):
        o, S = ttt_linear(*args, initial_state=(*floats, state[4]), segment_ids=segment_ids,
                          output_final_state=True, mode=mode)
        return jnp.sum(o * jnp.cos(o)) + sum(jnp.sum(s * jnp.sin(s)) for s in S[:4]), (o, *S)
    return jax.grad(loss, argnums=(0, 1), has_aux=True)(args, state[:4])


@pytest.mark.parametrize("T, packed", [(19, True), (1, False)])
def test_dual_form_matches_reference(T, packed):
    args, state = inputs(2, T, 2, 4)
    ids = jnp.asarray([[0] * 2 + [1] * 9 + [2] * 8, [0] * 6 + [1] * 13], jnp.int32)[:, :T] if packed else None
    (want_grads, want) = outputs_and_grads(args, state, ids, mode="recurrent")
    grads, got = outputs_and_grads(args, state, ids, mode="chunk")
    for name, a, b in zip(("o", "W", "b", "gW", "gb", "pos"), got, want):
        if name == "pos":
            np.testing.assert_array_equal(a, b)
        else:
            assert_close(a, b, what=f"chunk {name}")
    names = "q k v eta W0 b0 ln_w ln_b scale".split() + ["initial " + s for s in ("W", "b", "gW", "gb")]
    for name, a, b in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert_close(a, b, 1e-3, what=f"chunk d{name}")


def test_a_call_split_mid_mini_batch_continues():
    args, state = inputs(2, 13, 2, 4, seed=1)
    run = jax.jit(lambda args, state, mode: ttt_linear(*args, initial_state=state, output_final_state=True,
                                                       mode=mode), static_argnums=2)
    o, S = run(args, state, "recurrent")
    cut = lambda lo, hi: [a[:, lo:hi] for a in args[:4]] + args[4:]
    o1, S1 = run(cut(0, 6), state, "chunk")
    o2, S2 = run(cut(6, 13), S1, "chunk")
    assert_close(jnp.concatenate([o1, o2], axis=1), o, what="two calls vs one")
    for a, b in zip(S2, S):
        assert_close(a, b, what="state after two calls")


def test_first_mini_batch_matches_a_numpy_loop():
    args, _ = inputs(1, C, 2, 4, seed=2)
    q, k, v, eta, W0, b0, w, c, scale = (np.asarray(a, np.float64) for a in args)
    eps, K = 1e-6, q.shape[-1]
    norm = lambda z: (z - z.mean()) / np.sqrt(z.var() + eps)
    want = np.zeros(q.shape[1:])
    for h in range(q.shape[2]):
        GW, gb = np.zeros((K, K)), np.zeros(K)
        for t in range(C):
            z = k[0, t, h] @ W0[h] + b0[h]
            sigma, x_hat = np.sqrt(z.var() + eps), norm(z)
            J = w[h][:, None] * (np.eye(K) - 1 / K - np.outer(x_hat, x_hat) / K) / sigma  # dLN/dz, rows: outputs
            dz = J.T @ (w[h] * x_hat + c[h] - (v[0, t, h] - k[0, t, h]))
            GW, gb = GW + eta[0, t, h] * np.outer(k[0, t, h], dz), gb + eta[0, t, h] * dz
            W_t, b_t = W0[h] - scale[t] * GW, b0[h] - scale[t] * gb
            want[t, h] = q[0, t, h] + w[h] * norm(q[0, t, h] @ W_t + b_t) + c[h]
    for mode in ("chunk", "recurrent"):
        o, _ = jax.jit(functools.partial(ttt_linear, mode=mode))(*args)
        assert_close(o[0], want, what=f"{mode} vs numpy")


def test_bad_arguments():
    args, _ = inputs(1, 3, 1, 4)
    with pytest.raises(ValueError, match="mode='parallel'"):
        ttt_linear(*args, mode="parallel")
    with pytest.raises(ValueError, match="impl='pallas'"):
        ttt_linear(*args, impl="pallas")


def mlp_inputs(B, T, H, K, F, seed=0):
    """TTT-MLP's arguments (q, k, v, eta, W1, b1, W2, b2, ln_w, ln_b, scale) and a state stopped mid-mini-batch."""
    r = np.random.RandomState(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)
    (q, k, v, eta, _, _, ln_w, ln_b, scale), _ = inputs(B, T, H, K, seed)
    theta = (0.5 * n(H, K, F), 0.3 * n(H, F), 0.5 * n(H, F, K), 0.3 * n(H, K))
    state = (*(w + 0.1 * n(B, *w.shape) for w in theta), *(0.1 * n(B, *w.shape) for w in theta),
             np.asarray([1, 3][:B], np.int32))
    return [q, k, v, eta, *map(jnp.asarray, theta), ln_w, ln_b, scale], tuple(map(jnp.asarray, state))


def test_mlp_dual_form_matches_reference():
    """TTT-MLP: outputs, final state and gradients of the dual form against the reference (packed, T = 19 from
    a state stopped mid-mini-batch); a call from the learned start split mid-mini-batch into calls of 6, 1 and 6
    tokens; the reference's first mini-batch against jax.grad of the loss (not the written-out backward)."""
    args, state = mlp_inputs(2, 19, 2, 4, 8)
    ids = jnp.asarray([[0] * 2 + [1] * 9 + [2] * 8, [0] * 6 + [1] * 13], jnp.int32)

    @functools.partial(jax.jit, static_argnames="mode")
    def run(args, floats, *, mode):
        def loss(args, floats):
            o, S = ttt_mlp(*args, initial_state=(*floats, state[8]), segment_ids=ids, output_final_state=True,
                           mode=mode)
            return jnp.sum(o * jnp.cos(o)) + sum(jnp.sum(s * jnp.sin(s)) for s in S[:8]), (o, *S)
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(args, floats)

    want_grads, want = run(args, state[:8], mode="recurrent")
    grads, got = run(args, state[:8], mode="chunk")
    for name, a, b in zip("o W1 b1 W2 b2 gW1 gb1 gW2 gb2".split(), got, want):
        assert_close(a, b, what=f"dual {name}")
    np.testing.assert_array_equal(got[-1], want[-1])
    for i, (a, b) in enumerate(zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))):
        assert_close(a, b, 1e-3, what=f"dual gradient {i}")

    call = jax.jit(lambda args, S, mode: ttt_mlp(*args, initial_state=S, output_final_state=True, mode=mode),
                   static_argnums=2)
    cut = lambda lo, hi: [a[:, lo:hi] for a in args[:4]] + args[4:]
    o, S = call(cut(0, 13), None, "recurrent")  # from the learned start: its first mini-batch is checked below
    outs, S_split = [], None
    for lo, hi in ((0, 6), (6, 7), (7, 13)):  # T = 1 in the middle
        o_part, S_split = call(cut(lo, hi), S_split, "chunk")
        outs.append(o_part)
    assert_close(jnp.concatenate(outs, axis=1), o, what="three calls vs one")
    for a, b in zip(S_split, S):
        assert_close(a, b, what="state after three calls")

    @jax.jit
    def by_autodiff(args):  # the first mini-batch of row 0, each gradient by jax.grad at the start
        q, k, v, eta, W1, b1, W2, b2, w, c, scale = (a[0] if a.ndim == 4 or a.ndim == 3 and i < 4 else a
                                                     for i, a in enumerate(args))
        out = []
        for h in range(q.shape[1]):
            ln = lambda z: w[h] * (z - z.mean()) / jnp.sqrt(z.var() + 1e-6) + c[h]
            f = lambda th, x: jax.nn.gelu(x @ th[0] + th[1], approximate=True) @ th[2] + th[3]
            start = (W1[h], b1[h], W2[h], b2[h])
            G = jax.tree.map(jnp.zeros_like, start)
            for t in range(C):
                g = jax.grad(lambda th: 0.5 * jnp.sum((ln(f(th, k[t, h])) - (v[t, h] - k[t, h])) ** 2))(start)
                G = jax.tree.map(lambda G, g: G + eta[t, h] * g, G, g)
                out.append(q[t, h] + ln(f(jax.tree.map(lambda s, G: s - scale[t] * G, start, G), q[t, h])))
        return jnp.stack(out).reshape(q.shape[1], C, -1).swapaxes(0, 1)  # (C, H, K)
    assert_close(o[0, :C], by_autodiff(cut(0, C)), what="reference vs jax.grad")


def test_mlp_dual_form_under_jit_in_one_padded_mini_batch():
    """The shape that broke the dual form under jit (NaN in every row, while eager was right): one mini-batch of
    16 padded from 7 tokens, 4 heads of 32 (a config's), its next mini-batch's start selected away row by row."""
    rng = np.random.default_rng(0)
    H, K, F, T = 4, 32, 128, 7
    r = lambda *s: jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32)
    params = (r(H, K, F), r(H, F), r(H, F, K), r(H, K), 1 + r(H, K), r(H, K), jnp.linspace(1.0, 0.1, 16))
    q, k, v, eta = r(2, T, H, K), r(2, T, H, K), r(2, T, H, K), jnp.abs(r(2, T, H))
    run = lambda mode: jax.jit(lambda *a: ttt_mlp(*a, *params, mode=mode)[0])(q, k, v, eta)
    assert_close(run("chunk"), run("recurrent"), 1e-4, "dual vs reference, jitted")
