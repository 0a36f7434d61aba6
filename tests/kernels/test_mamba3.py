"""Mamba-3's SISO op: the reference against a loop written here from the paper's equations (outputs,
final state, document resets, the carried previous-token term); every form (chunk through XLA and through
kernels/ssd's CPU kernels, parallel, the Pallas kernels in interpret mode) against the reference on outputs,
final state and gradients w.r.t. every input and the initial state, T = 1 and T not a multiple of the
chunk; λ = 1 without rotation is Mamba-2's SSD; bfloat16 inputs and argument errors. The MIMO op
(mamba3_mimo, rank 2) the same way: its reference against the equations, its rewrite's forms against the
reference, and rank 1 with unit weights against the SISO op."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mamba3 import Mamba3Carry, mamba3, mamba3_mimo
from kernels.ssd import ssd
from tests.util import assert_close, unchecked

NAMES = ("x", "dt", "A", "lam", "B", "C", "theta", "D")
run = jax.jit(mamba3, static_argnames=("output_final_state", "mode", "chunk_size", "impl"))


def make_inputs(seed, Bsz, T, H, P, N):
    """Random inputs (numpy: no compile per shape) and a random initial carry. Δ about 0.3-3, A_t in
    [-4, -0.1], θ up to π: rotations of several radians per token."""
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)
    u = lambda lo, hi, *shape: jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)
    inputs = dict(x=f(Bsz, T, H, P), dt=jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H)))), jnp.float32),
                  A=u(-4.0, -0.1, Bsz, T, H), lam=u(0.0, 1.0, Bsz, T, H), B=f(Bsz, T, H, N), C=f(Bsz, T, H, N),
                  theta=u(-math.pi, math.pi, Bsz, T, H, N // 2), D=f(H))
    carry = Mamba3Carry(f(Bsz, H, P, N), u(0.0, 2 * math.pi, Bsz, H, N // 2), f(Bsz, H, N), f(Bsz, H, P))
    return inputs, carry


def angle_gap(a, b):
    """|a - b| on the circle: angles wrapped to [0, 2π) may land on either side of 0."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return np.abs((d + math.pi) % (2 * math.pi) - math.pi).max()


def assert_carry_close(got, want, what):
    for name in ("h", "b", "x"):
        assert_close(getattr(got, name), getattr(want, name), what=f"{what} final {name}")
    assert angle_gap(got.angle, want.angle) < 1e-4, f"{what} final angle"


@functools.cache
def outputs_and_grads(mode, chunk_size, impl="auto", op=mamba3):
    """jit(inputs, carry, segment_ids, weights) -> ((y, carry), grads of a random projection of both)."""

    def loss(inputs, carry, segment_ids, wy, wc):
        y, c = op(**inputs, initial_state=carry, segment_ids=segment_ids, output_final_state=True,
                      mode=mode, chunk_size=chunk_size, impl=impl)
        # The angle enters through cos and sin: wrapping it to [0, 2π) keeps its gradient.
        c_loss = sum(jnp.sum(a * w) for a, w in zip((c.h, jnp.sin(c.angle), c.b, c.x), wc))
        return jnp.sum(y * wy) + c_loss, (y, c)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def weights(seed, inputs, carry, y_shape=None):
    rng = np.random.default_rng(seed)
    w = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return w(y_shape or inputs["x"].shape), tuple(w(a.shape) for a in carry)


CASES = [  # (B, T, H, P, N, chunk_size, segment rows or None)
    (2, 37, 2, 4, 8, 16, [[0] * 16 + [1] * 5 + [2] * 16, [3] + [4] * 36]),  # starts at a chunk edge, at t = 1
    (1, 40, 1, 3, 4, 32, [[0] * 21 + [1] * 19]),  # a ragged second chunk
    (1, 1, 2, 2, 4, 16, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}P{}N{}".format(*c[:5]))
def test_forms_match_reference(case):
    Bsz, T, H, P, N, chunk, seg = case
    inputs, carry = make_inputs(T, Bsz, T, H, P, N)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    w = weights(1, inputs, carry)
    (want_gi, want_gc), (want_y, want_c) = outputs_and_grads("recurrent", chunk)(inputs, carry, seg, *w)
    # The Pallas kernels (interpret mode, slow to compile) on the first case only: ragged, packed, two chunks.
    forms = [("chunk", "xla"), ("parallel", "xla"), ("chunk", "auto")] + (  # auto: the CPU kernels where they build
        [("chunk", "pallas")] if case is CASES[0] else [])
    for mode, impl in forms:
        (gi, gc), (y, c) = outputs_and_grads(mode, chunk, impl)(inputs, carry, seg, *w)
        what = f"{mode}/{impl}"
        assert_close(y, want_y, what=f"{what} y")
        assert_carry_close(c, want_c, what)
        for name in NAMES:
            assert np.isfinite(np.asarray(gi[name])).all(), f"{what} d{name} not finite"
            assert_close(gi[name], want_gi[name], what=f"{what} d{name}")
        for name, a, b in zip(Mamba3Carry._fields, gc, want_gc):
            assert_close(a, b, what=f"{what} d initial {name}")


def test_reference_matches_the_papers_equations():
    """The reference against a float64 loop over the paper's recurrence, so it cannot drift: a document
    start at t = 3 zeroes h, Θ and the previous-token term; token 0 continues the carry."""
    Bsz, T, H, P, N = 1, 6, 1, 3, 4
    inputs, carry = make_inputs(5, Bsz, T, H, P, N)
    seg = jnp.array([[0, 0, 0, 1, 1, 1]], jnp.int32)
    y, c = run(**inputs, initial_state=carry, segment_ids=seg, mode="recurrent", output_final_state=True)
    x, dt, A, lam, B, C, theta = (np.asarray(inputs[k], np.float64)[0, :, 0] for k in NAMES[:-1])
    D = float(inputs["D"][0])
    h, angle, b_prev, x_prev = (np.asarray(a, np.float64)[0, 0] for a in carry)

    def R(v, angle):  # rotation of the pairs (n, n + N/2), the complex numbers v_n + i v_{n + N/2}
        z = (v[:N // 2] + 1j * v[N // 2:]) * np.exp(1j * angle)
        return np.concatenate([z.real, z.imag])

    outs = []
    for t in range(T):
        if t == 3:
            h, angle, b_prev, x_prev = (np.zeros_like(a) for a in (h, angle, b_prev, x_prev))
        angle = angle + dt[t] * theta[t]
        b, cc = R(B[t], angle), R(C[t], angle)
        alpha = np.exp(dt[t] * A[t])
        beta, gamma = (1 - lam[t]) * dt[t] * alpha, lam[t] * dt[t]
        h = alpha * h + beta * np.outer(x_prev, b_prev) + gamma * np.outer(x[t], b)
        outs.append(h @ cc + D * x[t])
        b_prev, x_prev = b, x[t]
    assert_close(np.asarray(y)[0, :, 0], np.stack(outs), what="y")
    assert_close(c.h[0, 0], h, what="h")
    assert angle_gap(c.angle[0, 0], angle) < 1e-5, "angle"
    assert_close(c.b[0, 0], b_prev, what="B̄_{t-1}")
    assert_close(c.x[0, 0], x_prev, what="x_{t-1}")


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_euler_without_rotation_is_mamba2_ssd(mode):
    """λ = 1 drops the second tap (exponential-Euler), θ = 0 the rotation, A_t = A_h constant: Mamba-2."""
    inputs, _ = make_inputs(7, 2, 21, 2, 3, 4)
    A_h = jnp.asarray([-0.5, -2.0], jnp.float32)
    inputs.update(A=jnp.broadcast_to(A_h, (2, 21, 2)), lam=jnp.ones((2, 21, 2)), theta=jnp.zeros((2, 21, 2, 2)))
    y, c = run(**inputs, output_final_state=True, mode=mode, chunk_size=8)
    ssd_run = jax.jit(ssd, static_argnames=("output_final_state", "mode"))
    want_y, want_h = ssd_run(inputs["x"], inputs["dt"], A_h, inputs["B"], inputs["C"], inputs["D"],
                             output_final_state=True, mode="recurrent")
    assert_close(y, want_y, what="y")
    assert_close(c.h, want_h, what="h")


def test_bfloat16_inputs():
    inputs, carry = make_inputs(9, 1, 33, 2, 8, 8)
    want, want_c = run(**inputs, initial_state=carry, output_final_state=True, mode="recurrent")
    low = {k: v.astype(jnp.bfloat16) for k, v in inputs.items()}
    y, c = run(**low, initial_state=carry, output_final_state=True, chunk_size=16)
    assert y.dtype == jnp.bfloat16 and c.h.dtype == jnp.float32
    assert_close(y, want, tol=5e-2, what="bf16 y")
    assert_close(c.h, want_c.h, tol=5e-2, what="bf16 h")


def test_argument_errors():
    inputs, _ = make_inputs(0, 1, 4, 1, 2, 4)
    with pytest.raises(ValueError, match="mamba3: mode='fused'"):
        mamba3(**inputs, mode="fused")
    with pytest.raises(ValueError, match="impl='triton'"):
        mamba3(**inputs, impl="triton")
    with unchecked(), pytest.raises(ValueError, match=r"theta \(B, T, H, N/2\)"):
        mamba3(**{**inputs, "theta": inputs["B"]})
    assert jax.eval_shape(lambda: mamba3(**inputs))[1] is None
    mimo, _ = make_mimo_inputs(0, 1, 4, 1, 2, 4, 2)
    with unchecked(), pytest.raises(ValueError, match=r"x_proj \(H, Mr, P\)"):
        mamba3_mimo(**{**mimo, "x_proj": mimo["x_proj"][:, :1]})


def make_mimo_inputs(seed, Bsz, T, H, P, N, R):
    """make_inputs with B, C (B, T, H, R, N), a lift x_proj (H, R, P) and a carry whose B̄ is (B, H, R, N)."""
    inputs, carry = make_inputs(seed, Bsz, T, H, P, N)
    rng = np.random.default_rng(seed + 1)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    inputs.update(B=f(Bsz, T, H, R, N), C=f(Bsz, T, H, R, N), x_proj=f(H, R, P))
    return inputs, carry._replace(b=f(Bsz, H, R, N))


def test_mimo_forms_match_reference():
    """One case (compiles dominate): T = 19 odd, chunks of 8 tokens (16 rank steps) with a ragged last one,
    documents starting at a chunk edge and at t = 1, an initial state."""
    Bsz, T, H, P, N, R, chunk = 2, 19, 2, 3, 4, 2, 8
    seg = [[0] * 8 + [1] * 3 + [2] * 8, [3] + [4] * 18]
    inputs, carry = make_mimo_inputs(T, Bsz, T, H, P, N, R)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    w = weights(2, inputs, carry, (Bsz, T, H, R, P))
    grads = lambda mode, impl="auto": outputs_and_grads(mode, chunk, impl, mamba3_mimo)(inputs, carry, seg, *w)
    (want_gi, want_gc), (want_y, want_c) = grads("recurrent")
    assert want_y.shape == (Bsz, T, H, R, P) and want_c.b.shape == (Bsz, H, R, N)
    # The Pallas kernels (interpret mode) on outputs and state only: their gradients are GLA's custom_vjp,
    # checked through the SISO rewrite above; compiling their backward here would double this test's time.
    y, c = jax.jit(mamba3_mimo, static_argnames=("output_final_state", "impl"))(
        **inputs, initial_state=carry, segment_ids=seg, output_final_state=True, impl="pallas")
    assert_close(y, want_y, what="MIMO pallas y")
    assert_carry_close(c, want_c, "MIMO pallas")
    for mode, impl in [("chunk", "xla"), ("parallel", "xla"), ("chunk", "auto")]:
        (gi, gc), (y, c) = grads(mode, impl)
        what = f"MIMO {mode}/{impl}"
        assert_close(y, want_y, what=f"{what} y")
        assert_carry_close(c, want_c, what)
        for name in (*NAMES, "x_proj"):
            assert np.isfinite(np.asarray(gi[name])).all(), f"{what} d{name} not finite"
            assert_close(gi[name], want_gi[name], what=f"{what} d{name}")
        for name, a, b in zip(Mamba3Carry._fields, gc, want_gc):
            assert_close(a, b, what=f"{what} d initial {name}")


def test_mimo_reference_matches_the_papers_equations():
    """The MIMO reference against a float64 loop: X = x ⊙ w_r, h_t = α h + β X_{t-1} B̄_{t-1}^T + γ X_t B̄_t^T,
    Y_t = h_t C̄_t + D X_t; a document start at t = 2 zeroes h, Θ and the previous-token term."""
    Bsz, T, H, P, N, R = 1, 5, 1, 3, 4, 3
    inputs, carry = make_mimo_inputs(11, Bsz, T, H, P, N, R)
    seg = jnp.array([[0, 0, 1, 1, 1]], jnp.int32)
    y, c = jax.jit(mamba3_mimo, static_argnames=("output_final_state", "mode"))(
        **inputs, initial_state=carry, segment_ids=seg, mode="recurrent", output_final_state=True)
    x, dt, A, lam, B, C, theta = (np.asarray(inputs[k], np.float64)[0, :, 0] for k in NAMES[:-1])
    D, W = float(inputs["D"][0]), np.asarray(inputs["x_proj"], np.float64)[0]  # W (R, P)
    h, angle, b_prev, x_prev = (np.asarray(a, np.float64)[0, 0] for a in carry)

    def R_(v, angle):  # each column's pairs (n, n + N/2) rotated by Θ
        z = (v[..., :N // 2] + 1j * v[..., N // 2:]) * np.exp(1j * angle)
        return np.concatenate([z.real, z.imag], axis=-1)

    outs = []
    for t in range(T):
        if t == 2:
            h, angle, b_prev, x_prev = (np.zeros_like(a) for a in (h, angle, b_prev, x_prev))
        angle = angle + dt[t] * theta[t]
        b, cc = R_(B[t], angle), R_(C[t], angle)  # (R, N)
        X, X_prev = (x[t] * W).T, (x_prev * W).T  # (P, R)
        alpha = np.exp(dt[t] * A[t])
        h = alpha * h + (1 - lam[t]) * dt[t] * alpha * X_prev @ b_prev + lam[t] * dt[t] * X @ b
        outs.append((h @ cc.T + D * X).T)  # (R, P)
        b_prev, x_prev = b, x[t]
    assert_close(np.asarray(y)[0, :, 0], np.stack(outs), what="Y")
    assert_close(c.h[0, 0], h, what="h")
    assert angle_gap(c.angle[0, 0], angle) < 1e-5, "angle"
    assert_close(c.b[0, 0], b_prev, what="B̄_{t-1}")
    assert_close(c.x[0, 0], x_prev, what="x_{t-1}")


def test_mimo_rank_one_is_siso(mode="recurrent"):
    """Rank 1 with a unit lift: the MIMO reference computes the SISO one, outputs and final state (each fast form
    is checked against its reference above)."""
    inputs, carry = make_inputs(13, 2, 21, 2, 3, 4)
    seg = jnp.asarray([[0] * 10 + [1] * 11, [2] * 21], jnp.int32)
    want, want_c = run(**inputs, initial_state=carry, segment_ids=seg, output_final_state=True, mode=mode,
                       chunk_size=8)
    rank1 = {**inputs, "B": inputs["B"][:, :, :, None], "C": inputs["C"][:, :, :, None], "x_proj": jnp.ones((2, 1, 3))}
    y, c = jax.jit(mamba3_mimo, static_argnames=("output_final_state", "mode", "chunk_size"))(
        **rank1, initial_state=carry._replace(b=carry.b[:, :, None]), segment_ids=seg, output_final_state=True,
        mode=mode, chunk_size=8)
    assert_close(y[:, :, :, 0], want, what="y")
    assert_carry_close(c._replace(b=c.b[:, :, 0]), want_c, "rank 1")
