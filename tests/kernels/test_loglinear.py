"""Log-linear Mamba-2 (kernels/loglinear): the level function against the official mask's definition, the
parallel form against the token-by-token reference (outputs, final Fenwick states and count, gradients w.r.t.
every input, initial state included) with packed documents, T = 1 and a level cap that binds, and the
reference against an independent numpy loop of the paper's equation, run in two calls (a continued state)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.loglinear import fenwick_level, loglinear_ssd, num_levels
from tests.util import assert_close


def mask_level(t: int, s: int, L: int) -> int:
    """Brute force from the definition of the official quadratic form: key s is at level 0 if s = t, else at
    the level ℓ ≥ 1 whose mask holds (t, s): bit ℓ - 1 of t set and t' - 2^(ℓ-1) <= s < t', t' = t with its
    low ℓ - 1 bits cleared. -1: no level (s > t)."""
    if s == t:
        return 0
    found = [lv for lv in range(1, L) if t % (1 << lv) >= 1 << (lv - 1)
             and s + (1 << (lv - 1)) >= t - t % (1 << (lv - 1)) and s < t - t % (1 << (lv - 1))]
    assert len(found) <= 1, (t, s, found)  # the buckets partition the prefix
    return found[0] if found else -1


def test_level_function_matches_the_mask_definition():
    T = 70
    L = num_levels(T)
    assert (num_levels(1), num_levels(2), num_levels(64), num_levels(65)) == (1, 2, 7, 8)
    brute = np.array([[mask_level(t, s, L) for s in range(T)] for t in range(T)])
    t, s = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    closed = np.asarray(fenwick_level(jnp.asarray(t, jnp.int32), jnp.asarray(s, jnp.int32)))
    causal = s <= t
    np.testing.assert_array_equal(closed[causal], brute[causal])
    assert (brute[~causal] == -1).all() and closed[causal].max() == L - 1


def make_inputs(seed, Bsz, T, H, P, G, N, L):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return dict(
        x=f(Bsz, T, H, P),
        dt=jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H)) - 1.0)), jnp.float32),
        A=jnp.asarray(-np.exp(np.linspace(-1.0, 1.0, H)), jnp.float32),
        B=f(Bsz, T, G, N),
        C=f(Bsz, T, G, N),
        lam=jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H, L)))), jnp.float32),
        D=f(H),
        initial_state=f(Bsz, H, L, P, N),
    )


@functools.cache
def outputs_and_grads(mode):
    def loss(inputs, count, segment_ids, wy, ws):
        y, (S, n) = loglinear_ssd(**inputs, initial_count=count, segment_ids=segment_ids, output_final_state=True,
                                  mode=mode)
        return jnp.sum(y * wy) + jnp.sum(S * ws), (y, S, n)

    return jax.jit(jax.grad(loss, has_aux=True))


CASES = [  # (B, T, H, P, G, N, L, initial counts, segment rows or None)
    (2, 21, 2, 3, 1, 4, 6, (5, 0), [[0] * 7 + [1] * 14, [3] + [4] * 20]),  # a 1-token document; n0 = 0
    (2, 21, 2, 2, 2, 3, 3, (13, 2), None),  # L = 3 < num_levels(21 + 13): the cap at level 2 binds
    (1, 1, 2, 2, 1, 3, 4, (6,), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[4]}L{c[6]}")
def test_parallel_matches_reference(case):
    Bsz, T, H, P, G, N, L, counts, seg = case
    inputs = make_inputs(T + L, Bsz, T, H, P, G, N, L)
    count = jnp.asarray(counts, jnp.int32)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    rng = np.random.default_rng(1)
    wy, ws = rng.standard_normal((Bsz, T, H, P)), rng.standard_normal((Bsz, H, L, P, N))
    ref_grads, (ref_y, ref_S, ref_n) = outputs_and_grads("recurrent")(inputs, count, seg, wy, ws)
    grads, (y, S, n) = outputs_and_grads("parallel")(inputs, count, seg, wy, ws)
    assert_close(y, ref_y, what="y")
    assert_close(S, ref_S, what="final states")
    np.testing.assert_array_equal(n, ref_n)
    for name in inputs:
        assert np.all(np.isfinite(grads[name])), f"d/d{name} not finite"
        assert_close(grads[name], ref_grads[name], what=f"d/d{name}")


def numpy_loglinear(x, dt, A, B, C, lam, D):
    """The paper's equation, one query at a time in float64 (one group, no documents, zero initial state)."""
    T, H = dt.shape
    y = np.zeros(x.shape)
    for t in range(T):
        for h in range(H):
            for s in range(t + 1):
                level = min((t ^ s).bit_length(), lam.shape[-1] - 1)
                decay = np.exp(A[h] * dt[s + 1:t + 1, h].sum())
                y[t, h] += lam[t, h, level] * decay * (C[t, 0] @ B[s, 0]) * dt[s, h] * x[s, h]
            y[t, h] += D[h] * x[t, h]
    return y


def test_reference_matches_a_numpy_loop_across_two_calls():
    T, cut = 13, 6
    inputs = make_inputs(0, 1, T, 2, 3, 1, 4, num_levels(T))
    inputs.pop("initial_state")
    want = numpy_loglinear(*(np.asarray(inputs[k], np.float64)[0] if k not in ("A", "D") else
                             np.asarray(inputs[k], np.float64) for k in ("x", "dt", "A", "B", "C", "lam", "D")))

    @jax.jit
    def two_calls(inputs):
        part = lambda lo, hi: {k: v[:, lo:hi] if v.ndim > 1 else v for k, v in inputs.items()}
        y0, (S, n) = loglinear_ssd(**part(0, cut), output_final_state=True, impl="reference")
        y1, _ = loglinear_ssd(**part(cut, T), initial_state=S, initial_count=n, impl="reference")
        return jnp.concatenate([y0, y1], axis=1), n

    y, n = two_calls(inputs)
    assert int(n[0]) == cut
    assert_close(y[0], want, what="reference in two calls vs numpy loop")


def test_packed_row_equals_documents_alone():
    """The reset rule: positions restart at a document start (the parallel form matches the reference above)."""
    lengths = (5, 1, 9)
    inputs = make_inputs(3, 1, sum(lengths), 2, 2, 1, 3, 4)
    inputs.pop("initial_state")
    seg = jnp.asarray([sum([[i] * n for i, n in enumerate(lengths)], [])], jnp.int32)
    run = jax.jit(functools.partial(loglinear_ssd, mode="parallel"))
    y = run(**inputs, segment_ids=seg)[0]
    t0 = 0
    for n in lengths:
        alone = run(**{k: v[:, t0:t0 + n] if v.ndim > 1 else v for k, v in inputs.items()})[0]
        assert_close(y[:, t0:t0 + n], alone, what=f"document at {t0}")
        t0 += n


def test_bad_impl_is_refused():
    with pytest.raises(ValueError, match="impl='pallas'"):
        loglinear_ssd(*(jnp.zeros(s) for s in ((1, 1, 1, 1), (1, 1, 1), (1,), (1, 1, 1, 1), (1, 1, 1, 1),
                                               (1, 1, 1, 1))), impl="pallas")
