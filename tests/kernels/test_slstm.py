"""sLSTM op (its one form, the scan of kernels/slstm/reference.py) against the paper's equations written
here independently: a float64 numpy loop of the stabilised cell (outputs and final state c, n, m, h), and the
unstabilised cell (c̄ = f c̄ + e^ĩ z, n̄ = f n̄ + e^ĩ, h = o c̄ / n̄) in JAX on small inputs, which the stabiliser
must not change (outputs and gradients w.r.t. every input, the initial state included). Packed documents
equal the documents alone, a state carried between calls equals one call, large gates stay finite, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.slstm import slstm
from tests.util import assert_close, unchecked

# B, T, H, K, packed, initial state, forget gate. T = 1 a single token; 13 and 9 odd lengths.
CASES = [(2, 1, 2, 3, False, False, "sigmoid"), (2, 13, 2, 3, True, True, "sigmoid"), (1, 9, 1, 4, False, True, "exp")]


def rand(seed, shape, scale=1.0):
    """numpy, not jax.random: eager jax.random compiles a kernel per shape."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def make_inputs(B, T, H, K, seed=0, scale=1.0):
    """x (B, T, 4, H, K), R (4, H, K, K), b (4, H, K) and a state (c, n, m, h) as a cell leaves it (n >= 1)."""
    x, R, b = rand(seed, (B, T, 4, H, K), scale), rand(seed + 1, (4, H, K, K), 0.5), rand(seed + 2, (4, H, K))
    c, m, h = rand(seed + 3, (B, H, K)), rand(seed + 4, (B, H, K)), np.tanh(rand(seed + 5, (B, H, K)))
    n = 1 + np.abs(rand(seed + 6, (B, H, K)))
    return x, R, b, (c, n, m, h)


def packed_ids(B, T, seed=0):
    return np.sort(np.random.default_rng(seed).integers(0, 3, (B, T)), axis=1).astype(np.int32)


def numpy_slstm(x, R, b, state, segment_ids, forget_gate):
    """The paper's stabilised cell, one token at a time in float64; an empty state (n = 0) takes m = ĩ."""
    x, R, b = (np.asarray(a, np.float64) for a in (x, R, b))
    B, T, _, H, K = x.shape
    c, n, m, h = (np.zeros((B, H, K)),) * 4 if state is None else (np.array(s, np.float64) for s in state)
    out = np.zeros((B, T, H, K))
    for t in range(T):
        if segment_ids is not None and t > 0:
            new = (segment_ids[:, t] != segment_ids[:, t - 1])[:, None, None]
            c, n, m, h = (np.where(new, 0.0, s) for s in (c, n, m, h))
        pre = x[:, t] + np.einsum("bhk,ghkj->bghj", h, R) + b
        i_t, f_t, z_t, o_t = pre[:, 0], pre[:, 1], pre[:, 2], pre[:, 3]
        log_f = -np.logaddexp(0, -f_t) if forget_gate == "sigmoid" else f_t
        m_new = np.where(n == 0, i_t, np.maximum(log_f + m, i_t))
        i_p = np.exp(i_t - m_new)
        f_p = np.where(n == 0, 0.0, np.exp(np.minimum(log_f + m - m_new, 0)))
        c, n, m = f_p * c + i_p * np.tanh(z_t), f_p * n + i_p, m_new
        h = c / n / (1 + np.exp(-o_t))
        out[:, t] = h
    return out, (c, n, m, h)


def unstabilised(x, R, b, state, segment_ids, forget_gate):
    """h_t of the cell without the stabiliser (exact where nothing overflows), in JAX: the true c̄ = c e^m."""
    starts = jnp.zeros(x.shape[:2], bool) if segment_ids is None else \
        jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    c, n, m, h = state
    carry = (c * jnp.exp(m), n * jnp.exp(m), h)

    def step(carry, inputs):
        x_t, new = inputs
        c, n, h = (jnp.where(new[:, None, None], 0.0, s) for s in carry)
        pre = x_t + jnp.einsum("bhk,ghkj->bghj", h, R) + b
        f = jax.nn.sigmoid(pre[:, 1]) if forget_gate == "sigmoid" else jnp.exp(pre[:, 1])
        c = f * c + jnp.exp(pre[:, 0]) * jnp.tanh(pre[:, 2])
        n = f * n + jnp.exp(pre[:, 0])
        h = jax.nn.sigmoid(pre[:, 3]) * c / n
        return (c, n, h), h

    _, out = jax.lax.scan(step, carry, (jnp.moveaxis(x, 1, 0), jnp.moveaxis(starts, 1, 0)))
    return jnp.moveaxis(out, 0, 1)


@functools.partial(jax.jit, static_argnames="forget_gate")
def outputs_and_grads(x, R, b, state, segment_ids, weight, forget_gate):
    """The op's h and final state and the unstabilised cell's h, each with the gradients of sum(h * weight)
    w.r.t. x, R, b and the initial state."""
    def op(x, R, b, state):
        h, final = slstm(x, R, b, segment_ids=segment_ids, initial_state=state, output_final_state=True,
                         forget_gate=forget_gate)
        return jnp.sum(h * weight), (h, final)

    def plain(x, R, b, state):
        h = unstabilised(x, R, b, state, segment_ids, forget_gate)
        return jnp.sum(h * weight), h

    grads, (h, final) = jax.grad(op, argnums=(0, 1, 2, 3), has_aux=True)(x, R, b, state)
    plain_grads, plain_h = jax.grad(plain, argnums=(0, 1, 2, 3), has_aux=True)(x, R, b, state)
    return h, final, grads, plain_h, plain_grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}K{}{}{}-{}".format(
    *c[:4], "-packed" if c[4] else "", "-init" if c[5] else "", c[6]))
def test_op_matches_the_equations_and_the_unstabilised_cell(case):
    B, T, H, K, packed, init, forget_gate = case
    x, R, b, state = make_inputs(B, T, H, K)
    seg = packed_ids(B, T) if packed else None
    if not init:  # the zero state (empty: its stabiliser starts at the first ĩ), passed as zeros
        state = tuple(np.zeros_like(s) for s in state)
    weight = rand(9, (B, T, H, K))
    h, final, grads, plain_h, plain_grads = outputs_and_grads(*map(jnp.asarray, (x, R, b)), tuple(map(
        jnp.asarray, state)), None if seg is None else jnp.asarray(seg), jnp.asarray(weight), forget_gate)
    want_h, want_final = numpy_slstm(x, R, b, state, seg, forget_gate)
    assert_close(h, want_h, 1e-5, "h vs the numpy loop")
    for name, got, want in zip("cnmh", final, want_final):
        assert_close(got, want, 1e-5, f"final {name} vs the numpy loop")
    assert_close(h, plain_h, 1e-5, "h vs the unstabilised cell")
    for name, got, want in zip(("x", "R", "b"), grads[:3], plain_grads[:3]):
        assert np.isfinite(np.asarray(got)).all(), f"d/d{name} not finite"
        assert_close(got, want, 1e-4, f"d/d{name} vs the unstabilised cell")
    for name, got, want in zip("cnmh", grads[3], plain_grads[3]):
        if init:  # from a zero state only h0 = 0 and the empty state's m are meaningful
            assert_close(got, want, 1e-4, f"d/d{name}_0 vs the unstabilised cell")


@functools.partial(jax.jit, static_argnames="P")
def pieces(x, R, b, seg, alone, P):
    """The whole packed call; the same call in two pieces (the state carried); each document alone; unpacked."""
    h, final = slstm(x, R, b, segment_ids=seg, output_final_state=True)
    h1, mid = slstm(x[:, :P], R, b, segment_ids=seg[:, :P], output_final_state=True)
    h2, end = slstm(x[:, P:], R, b, segment_ids=seg[:, P:], initial_state=mid, output_final_state=True)
    return h, final, jnp.concatenate([h1, h2], axis=1), end, slstm(alone, R, b)[0], slstm(x, R, b)[0]


def test_packed_documents_equal_documents_alone_and_state_carries_between_calls():
    B, T, P = 2, 11, 5  # token 0 of a call continues its state: no document starts at P
    x, R, b, _ = make_inputs(B, T, 2, 3, seed=3)
    seg = np.array([[0] * 4 + [1] * 7, [0] * 6 + [1] + [2] * 4], np.int32)
    docs = [(0, 0, 4), (0, 4, 11), (1, 0, 6), (1, 6, 7), (1, 7, 11)]  # (row, start, end)
    alone = np.stack([np.roll(x[row], -start, axis=0) for row, start, _ in docs])  # each first in a row of its own
    h, final, h_pieces, end, h_alone, unpacked = pieces(*map(jnp.asarray, (x, R, b, seg, alone)), P=P)
    for i, (row, start, end_) in enumerate(docs):
        assert_close(h[row, start:end_], h_alone[i, :end_ - start], 1e-5, f"document {i} packed vs alone")
    assert_close(h_pieces, h, 1e-5, "two calls, the state carried, vs one call")
    for name, got, want in zip("cnmh", end, final):
        assert_close(got, want, 1e-5, f"final {name}: two calls vs one")
    assert not np.allclose(h[0, 4:], unpacked[0, 4:], atol=1e-3), "the document reset is not real"


def test_large_gates_stay_finite_where_the_unstabilised_cell_overflows():
    x, R, b, _ = make_inputs(1, 5, 1, 4, seed=5, scale=60.0)  # ĩ up to ~150: e^ĩ overflows float32
    h, final = slstm(jnp.asarray(x), jnp.asarray(R), jnp.asarray(b), output_final_state=True)
    assert np.isfinite(np.asarray(h)).all() and all(np.isfinite(np.asarray(s)).all() for s in final)
    assert_close(h, numpy_slstm(x, R, b, None, None, "sigmoid")[0], 1e-5, "h vs the numpy loop (float64)")


def test_errors():
    x, R, b = map(jnp.asarray, make_inputs(1, 2, 2, 3)[:3])
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        slstm(x, R, b, impl="pallas")
    with pytest.raises(ValueError, match="forget_gate='tanh'"):
        slstm(x, R, b, forget_gate="tanh")
    with unchecked(), pytest.raises(ValueError, match=r"expected x \(B, T, 4, H, K\)"):
        slstm(x, R[:, :, :2], b)
