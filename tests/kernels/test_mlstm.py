"""mLSTM op: every mode against the token-by-token reference (outputs, final state (C, n, m), gradients
w.r.t. q, k, v, both gates and the initial state), the reference against a plain loop over the paper's
equations, packed documents, the stabiliser's independence, dtypes and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mlstm import mlstm
from kernels.mlstm.reference import mlstm_reference
from tests.util import assert_close

# B, T, H, K, V, chunk_size, packed. T=37/C=16 pads the last chunk, packed documents start inside chunks;
# T=1 is a single token.
CASES = [(2, 37, 2, 8, 16, 16, True), (1, 1, 1, 8, 8, 16, False)]


def randn(seed, shape, scale=1.0):
    # numpy, not jax.random: eager jax ops would each cost a compile, and compiles dominate this file.
    return jnp.asarray(scale * np.random.RandomState(seed).standard_normal(shape), jnp.float32)


def make_inputs(B, T, H, K, V, seed=0):
    q, k, v = randn(seed, (B, T, H, K)), randn(seed + 1, (B, T, H, K)), randn(seed + 2, (B, T, H, V))
    i_pre = 3 * np.random.RandomState(seed + 3).standard_normal((B, T, H))
    f_pre = 2 * np.random.RandomState(seed + 4).standard_normal((B, T, H)) + 3
    if T > 2:  # (at T = 1 alone, the write of e^80 would leave h = sign(q . k) v, without a q gradient)
        i_pre[:, T // 2, 0] = 80.0  # e^80 times any other write: unstabilised, C would overflow float32 soon after
        f_pre[:, T // 3, -1] = -30.0  # forgets at once
    state = (randn(seed + 5, (B, H, K, V)), randn(seed + 6, (B, H, K)), randn(seed + 7, (B, H)))
    return q, k, v, jnp.asarray(i_pre, jnp.float32), jnp.asarray(f_pre, jnp.float32), state


def packed_ids(B, T, seed=0):
    return jnp.asarray(np.sort(np.random.RandomState(seed).randint(0, 4, (B, T)), axis=1), jnp.int32)


@functools.partial(jax.jit, static_argnames=("mode", "chunk_size"))
def outputs_and_grads(q, k, v, i_pre, f_pre, state, wh, ws, segment_ids, *, mode, chunk_size):
    """(h, (C, n, m)) and the gradients of a random projection of both w.r.t. every input and the state."""
    def loss(q, k, v, i_pre, f_pre, state):
        h, final = mlstm(q, k, v, i_pre, f_pre, initial_state=state, segment_ids=segment_ids,
                         output_final_state=True, mode=mode, chunk_size=chunk_size)
        return jnp.sum(h * wh) + sum(jnp.sum(s * w) for s, w in zip(final, ws)), (h, final)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(q, k, v, i_pre, f_pre, state)


reference = jax.jit(mlstm_reference)
run = jax.jit(mlstm, static_argnames=("mode", "chunk_size", "output_final_state"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}K{}V{}C{}".format(*c[:6]))
def test_modes_match_reference(case):
    B, T, H, K, V, C, packed = case
    *inputs, state = make_inputs(B, T, H, K, V)
    extra = (randn(10, (B, T, H, V)), (randn(11, (B, H, K, V)), randn(12, (B, H, K)), randn(13, (B, H))),
             packed_ids(B, T) if packed else None)
    want_grads, (want_h, want_S) = outputs_and_grads(*inputs, state, *extra, mode="recurrent", chunk_size=C)
    for mode in ("chunk", "parallel"):
        grads, (h, S) = outputs_and_grads(*inputs, state, *extra, mode=mode, chunk_size=C)
        assert_close(h, want_h, what=f"{mode} h")
        for name, a, b in zip("Cnm", S, want_S):
            assert_close(a, b, what=f"{mode} final {name}")
        grads = (*grads[:5], *grads[5])
        for name, a, b in zip(("dq", "dk", "dv", "di", "df", "dC0", "dn0", "dm0"), grads, (*want_grads[:5],
                                                                                         *want_grads[5])):
            assert np.isfinite(np.asarray(a)).all(), f"{mode} {name} not finite"
            assert_close(a, b, what=f"{mode} {name}")


def test_reference_matches_explicit_loop():
    """The reference against a float64 loop over the unstabilised equations, h = C q / max(|n q|, 1), so it
    cannot drift; m only rescales (C, n), the loop's state is e^m times the reference's."""
    q, k, v, i_pre, f_pre, (C0, n0, m0) = make_inputs(1, 5, 1, 4, 3, seed=20)
    seg = jnp.array([[0, 0, 1, 1, 1]], jnp.int32)
    h, (C, n, m) = reference(q, k, v, i_pre, f_pre, segment_ids=seg, initial_state=(C0, n0, m0))
    q, k, v = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v))  # (T, K) or (T, V)
    i_pre, f_pre = (np.asarray(x, np.float64)[0, :, 0] for x in (i_pre, f_pre))
    scale = np.exp(float(m0[0, 0]))
    Ct, nt = np.asarray(C0, np.float64)[0, 0] * scale, np.asarray(n0, np.float64)[0, 0] * scale
    outs = []
    for t in range(5):
        if t == 2:  # document start: the state resets
            Ct, nt = np.zeros_like(Ct), np.zeros_like(nt)
        f, i, kt = 1 / (1 + np.exp(-f_pre[t])), np.exp(i_pre[t]), k[t] / 2.0  # k / sqrt(K), K = 4
        Ct, nt = f * Ct + i * np.outer(kt, v[t]), f * nt + i * kt
        outs.append(q[t] @ Ct / max(abs(q[t] @ nt), 1.0))
    assert_close(np.asarray(h)[0, :, 0], np.stack(outs), what="h")
    assert_close(np.asarray(C)[0, 0] * np.exp(float(m[0, 0])), Ct, what="C e^m")
    assert_close(np.asarray(n)[0, 0] * np.exp(float(m[0, 0])), nt, what="n e^m")


def test_packed_row_equals_documents_alone():
    T, H, K, V = 29, 2, 8, 8
    q, k, v, i_pre, f_pre, S0 = make_inputs(1, T, H, K, V, seed=30)
    bounds = [0, 12, 13, 22, T]  # documents of 12, 1, 9 and 7 tokens
    seg = np.repeat(np.arange(4, dtype=np.int32), np.diff(bounds))[None]
    h, S = run(q, k, v, i_pre, f_pre, segment_ids=seg, initial_state=S0, output_final_state=True, chunk_size=8)
    # The documents alone, one per batch row, the later ones padded in front with tokens that leave the
    # zero state as it is: q = k = v = 0, ĩ = -1e4 (no write, m stays 0) and f̃ = 1e4 (log f = 0).
    L = bounds[1]
    pad = lambda x, n, value: np.pad(np.asarray(x)[0], [(n, 0)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
    alone = [np.stack([pad(x[:, a:b], L - (b - a), value) for a, b in zip(bounds, bounds[1:])])
             for x, value in ((q, 0), (k, 0), (v, 0), (i_pre, -1e4), (f_pre, 1e4))]
    inits = tuple(np.concatenate([s, np.zeros((3,) + s.shape[1:], np.float32)]) for s in S0)  # only token 0 has S0
    h_alone, S_alone = reference(*alone, initial_state=inits)
    for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
        assert_close(h[0, a:b], h_alone[d, L - (b - a):], what=f"document {d}")
    for name, s, s_alone in zip("Cnm", S, S_alone):
        assert_close(s[0], s_alone[-1], what=f"final {name}")


def test_bfloat16_inputs():
    *inputs, S0 = make_inputs(1, 21, 2, 8, 8, seed=40)
    want, want_S = run(*inputs, initial_state=S0, output_final_state=True, mode="recurrent")
    lo = [jnp.asarray(np.asarray(x), jnp.bfloat16) for x in inputs]
    h, S = run(*lo, initial_state=S0, output_final_state=True, chunk_size=8)
    assert h.dtype == jnp.bfloat16 and all(s.dtype == jnp.float32 for s in S)
    assert_close(h, want, tol=5e-2, what="bf16 h")
    assert_close(S[0] * jnp.exp(S[2])[..., None, None], want_S[0] * jnp.exp(want_S[2])[..., None, None], tol=5e-2,
                 what="bf16 C e^m")


def test_argument_errors():
    *inputs, _ = make_inputs(1, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="mlstm: mode='fused'"):
        mlstm(*inputs, mode="fused")
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        mlstm(*inputs, impl="pallas")
    with pytest.raises(ValueError, match="impl='triton'"):
        mlstm(*inputs, impl="triton")
    assert jax.eval_shape(lambda: mlstm(*inputs))[1] is None
