"""S4D op: the FFT convolution form against the token-by-token recurrence (outputs, final state, and
gradients w.r.t. u, A, Δ, C, D and the initial state), the recurrence against a loop over the paper's
equations, the two forms at T = 4096 against each other and a float64 truth, packed documents, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.s4d import s4d
from tests.util import assert_close, unchecked

# B, T, Dm, N (complex modes), packed. T = 37 is ragged, T = 1 a single token.
CASES = [(2, 37, 3, 4, False), (2, 37, 3, 4, True), (1, 1, 2, 3, False)]


def inputs(B, T, Dm, N, seed=0, dt=(1e-2, 0.5)):
    """u, A (S4D-Lin with a random real part), Δ, C, D, h0, as real arrays (complex ones split in two)."""
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)
    A_re = jnp.asarray(-r.uniform(0.2, 1.0, (Dm, N)), jnp.float32)
    A_im = jnp.asarray(np.pi * np.arange(N) * np.ones((Dm, 1)), jnp.float32)
    log_dt = jnp.asarray(r.uniform(np.log(dt[0]), np.log(dt[1]), Dm), jnp.float32)
    return f(B, T, Dm), A_re, A_im, log_dt, f(Dm, N), f(Dm, N), f(Dm), f(B, Dm, N), f(B, Dm, N)


def pairs(h):
    """A complex array as real pairs, (..., 2): tests.util compares real arrays."""
    h = np.asarray(h)
    return np.stack([h.real, h.imag], -1)


def packed_ids(B, T, seed=0):
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, (B, T)), axis=1), jnp.int32)


@functools.partial(jax.jit, static_argnames=("mode", "impl"))
def outputs_and_grads(u, A_re, A_im, log_dt, C_re, C_im, D, h_re, h_im, wy, wh, segment_ids, *, mode, impl="xla"):
    def loss(*args):
        u, A_re, A_im, log_dt, C_re, C_im, D, h_re, h_im = args
        y, h = s4d(u, jax.lax.complex(A_re, A_im), jnp.exp(log_dt), jax.lax.complex(C_re, C_im), D,
                   segment_ids=segment_ids, initial_state=jax.lax.complex(h_re, h_im), output_final_state=True,
                   mode=mode, impl=impl)
        return jnp.sum(y * wy) + jnp.sum(jnp.real(h) * wh) - jnp.sum(jnp.imag(h) * wh), (y, h)
    return jax.grad(loss, argnums=tuple(range(9)), has_aux=True)(u, A_re, A_im, log_dt, C_re, C_im, D, h_re, h_im)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}Dm{}N{}{}".format(*c[:4], "packed" if c[4] else ""))
def test_fft_matches_recurrence(case):
    B, T, Dm, N, packed = case
    args = inputs(B, T, Dm, N)
    r = np.random.default_rng(1)
    extra = (jnp.asarray(r.standard_normal((B, T, Dm)), jnp.float32), jnp.asarray(r.standard_normal((B, Dm, N)),
             jnp.float32), packed_ids(B, T) if packed else None)
    want_grads, (want_y, want_h) = outputs_and_grads(*args, *extra, mode="recurrent", impl="reference")
    grads, (y, h) = outputs_and_grads(*args, *extra, mode="fft")
    assert_close(y, want_y, what="fft y")
    assert_close(pairs(h), pairs(want_h), what="fft final state")
    names = ("du", "dA_re", "dA_im", "dlog_dt", "dC_re", "dC_im", "dD", "dh0_re", "dh0_im")
    for name, a, b in zip(names, grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(a)).all() and np.abs(np.asarray(b)).max() > 0, name
        assert_close(a, b, what=f"fft {name}")
    A, C = jax.lax.complex(args[1], args[2]), jax.lax.complex(args[4], args[5])  # no state in, none out
    plain = [jax.jit(s4d, static_argnames="impl")(args[0], A, jnp.exp(args[3]), C, args[6], segment_ids=extra[2],
                                                   impl=impl)[0] for impl in ("reference", "xla")]
    assert_close(plain[1], plain[0], what="fft y from a zero state")


def test_recurrence_matches_the_papers_equations():
    """The reference against a float64 loop over ZOH and the recurrence, a document start at t = 3."""
    u, A_re, A_im, log_dt, C_re, C_im, D, h_re, h_im = inputs(1, 6, 2, 3, seed=5)
    seg = jnp.asarray([[0, 0, 0, 4, 4, 4]], jnp.int32)
    A, C, h0 = (jax.lax.complex(a, b) for a, b in ((A_re, A_im), (C_re, C_im), (h_re, h_im)))
    y, h = s4d(u, A, jnp.exp(log_dt), C, D, segment_ids=seg, initial_state=h0, output_final_state=True,
               impl="reference")
    A, C, h0 = (np.asarray(x, np.complex128) for x in (A, C, h0))
    dt, D, u = np.exp(np.asarray(log_dt, np.float64)), np.asarray(D, np.float64), np.asarray(u, np.float64)[0]
    Abar = np.exp(dt[:, None] * A)
    Bbar = (Abar - 1) / A  # (ΔA)^{-1} (exp(ΔA) - I) ΔB with B = 1
    state, ys = h0[0], []
    for t in range(6):
        if t == 3:
            state = np.zeros_like(state)
        state = Abar * state + Bbar * u[t][:, None]
        ys.append(2 * np.real((C * state).sum(-1)) + D * u[t])
    assert_close(np.asarray(y)[0], np.stack(ys), what="y")
    assert_close(pairs(h)[0], pairs(state), what="h")


def test_fft_equals_recurrence_at_4096():
    """S4D's FFT convolution equals its recurrence to float32 rounding for T = 4096, slow modes included
    (Δ down to 1e-3: |Ā| = exp(-Δ/2) near 1, a memory of thousands of tokens). Against a float64 loop the
    FFT form is the closer (about 1e-6 relative on y, measured); the float32 recurrence's error grows
    with T (about 1e-5 at 4096: each step rounds Ā h)."""
    B, T, Dm, N = 1, 4096, 4, 8
    u, A_re, A_im, log_dt, C_re, C_im, D, h_re, h_im = inputs(B, T, Dm, N, dt=(1e-3, 0.1))
    A, C, h0 = (jax.lax.complex(a, b) for a, b in ((A_re, A_im), (C_re, C_im), (h_re, h_im)))
    run = jax.jit(functools.partial(s4d, output_final_state=True), static_argnames="mode")
    y_rec, h_rec = run(u, A, jnp.exp(log_dt), C, D, initial_state=h0, mode="recurrent")
    y_fft, h_fft = run(u, A, jnp.exp(log_dt), C, D, initial_state=h0, mode="fft")
    assert_close(y_fft, y_rec, 1e-4, "fft vs recurrence, y")
    assert_close(pairs(h_fft), pairs(h_rec), 1e-4, "fft vs recurrence, final state")
    # float64 truth, vectorised over channels and modes
    Ab = np.exp(np.exp(np.asarray(log_dt, np.float64))[:, None] * np.asarray(A, np.complex128))
    Bb, C64, state = (Ab - 1) / np.asarray(A, np.complex128), np.asarray(C, np.complex128), np.asarray(h0)[0]
    u64, ys = np.asarray(u, np.float64)[0], np.empty((T, Dm))
    for t in range(T):
        state = Ab * state + Bb * u64[t][:, None]
        ys[t] = 2 * np.real((C64 * state).sum(-1))
    ys += np.asarray(D, np.float64) * u64
    assert_close(np.asarray(y_fft)[0], ys, 1e-5, "fft vs float64")
    assert_close(np.asarray(y_rec)[0], ys, 1e-4, "recurrence vs float64")


def test_bad_arguments_are_named():
    u, A_re, A_im, log_dt, C_re, C_im, D, *_ = inputs(1, 4, 2, 3)
    A, C = jax.lax.complex(A_re, A_im), jax.lax.complex(C_re, C_im)
    with unchecked(), pytest.raises(ValueError, match="expected u"):
        s4d(u, A[:1], jnp.exp(log_dt), C, D)
    with pytest.raises(ValueError, match="mode="):
        s4d(u, A, jnp.exp(log_dt), C, D, mode="chunk")
    with pytest.raises(ValueError, match="impl='pallas'"):
        s4d(u, A, jnp.exp(log_dt), C, D, impl="pallas")
