"""The RG-LRU's associative-scan form against the token-by-token reference: outputs, final state and
gradients w.r.t. every input (x, r, i, Λ, initial_state), with document starts (where the state drops and
the multiplier is 1) and rows whose token 0 does or does not begin a document."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.rglru import MODES, rglru
from kernels.rglru.reference import bounded_sqrt
from tests.util import assert_close, unchecked

run = jax.jit(rglru, static_argnames=("c", "output_final_state", "mode", "impl"))


def make_inputs(seed, Bsz, T, Dm):
    """Random inputs, drawn with numpy (no XLA compile per shape). Λ spans a = σ(Λ) from 0.5 to 0.9999 and
    the gates reach near 0, so a_t near 1 (the multiplier's steep end) occurs."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    sig = lambda *shape: jnp.asarray(1 / (1 + np.exp(-3 * rng.standard_normal(shape))), jnp.float32)
    return dict(x=f(Bsz, T, Dm), gate_a=sig(Bsz, T, Dm), gate_x=sig(Bsz, T, Dm),
                a_param=jnp.asarray(rng.uniform(0.0, 9.0, Dm), jnp.float32), initial_state=f(Bsz, Dm))


@functools.cache
def outputs_and_grads(mode, impl="xla"):
    """jit(inputs, segment_ids, first_starts, weights) -> ((y, h_T), grads of a random projection of both)."""

    def loss(inputs, segment_ids, first, wy, wh):
        y, h = rglru(**inputs, segment_ids=segment_ids, first_starts=first, output_final_state=True, mode=mode,
                     impl=impl)
        return jnp.sum(y * wy) + jnp.sum(h * wh), (y, h)

    return jax.jit(jax.grad(loss, has_aux=True))


CASES = [  # (B, T, Dm, segment rows or None, first_starts)
    (2, 37, 6, [[0] * 20 + [1] * 16 + [2], [5] + [6] * 36], [False, True]),  # a one-token last document
    (1, 1, 3, None, [False]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}Dm{c[2]}")
def test_modes_match_reference(case):
    Bsz, T, Dm, seg, first = case
    inputs = make_inputs(T, Bsz, T, Dm)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    first = jnp.asarray(first)
    rng = np.random.default_rng(1)
    wy, wh = rng.standard_normal((Bsz, T, Dm)), rng.standard_normal((Bsz, Dm))
    ref_grads, (ref_y, ref_h) = outputs_and_grads("recurrent", "reference")(inputs, seg, first, wy, wh)
    for mode in MODES:
        grads, (y, h) = outputs_and_grads(mode)(inputs, seg, first, wy, wh)
        assert_close(y, ref_y, what=f"{mode} y")
        assert_close(h, ref_h, what=f"{mode} final state")
        for name in inputs:
            assert np.all(np.isfinite(grads[name])), f"{mode} d/d{name} not finite"
            assert_close(grads[name], ref_grads[name], what=f"{mode} d/d{name}")


def test_reference_is_the_equations_and_a_packed_row_equals_its_documents_alone():
    """The recurrence written out in numpy float64 on a packed row; then each document alone (no state: its
    token 0 begins it) gives the same outputs, and the final state is the last document's."""
    lengths = (4, 1, 6)
    T = sum(lengths)
    inputs = make_inputs(3, 1, T, 4)
    seg = jnp.asarray([sum([[i] * n for i, n in enumerate(lengths)], [])], jnp.int32)
    y, h = run(**{**inputs, "initial_state": None}, segment_ids=seg, output_final_state=True, mode="recurrent")
    x, r, i, lam = (np.asarray(inputs[k], np.float64) for k in ("x", "gate_a", "gate_x", "a_param"))
    a = (1 / (1 + np.exp(-lam))) ** (8 * r[0])  # (T, Dm) a_t = σ(Λ)^(c r_t)
    starts = {sum(lengths[:k]) for k in range(len(lengths))}
    want, state = [], np.zeros(4)
    for t in range(T):
        state = (i[0, t] * x[0, t] if t in starts else a[t] * state + np.sqrt(1 - a[t] ** 2) * i[0, t] * x[0, t])
        want.append(state)
    assert_close(y[0], np.stack(want), what="reference vs the equations")
    t0 = 0
    for k, n in enumerate(lengths):
        doc = {name: v[:, t0:t0 + n] for name, v in inputs.items() if name in ("x", "gate_a", "gate_x")}
        y_doc, h_doc = run(**doc, a_param=inputs["a_param"], output_final_state=True, mode="parallel")
        assert_close(y[:, t0:t0 + n], y_doc, what=f"document {k}")
        t0 += n
    assert_close(h, h_doc, what="final state = last document's")


def test_bounded_sqrt_gradient_and_dtypes():
    grad = jax.grad(lambda u: bounded_sqrt(u).sum())(jnp.asarray([0.0, 1e-9, 0.25]))
    np.testing.assert_allclose(grad, [1000.0, 1000.0, 1.0], rtol=1e-5)
    low = {k: v.astype(jnp.bfloat16) for k, v in make_inputs(4, 1, 5, 2).items()}
    for mode in MODES:  # abstract evaluation: dtypes without a compile
        y, h = jax.eval_shape(lambda i: rglru(**i, output_final_state=True, mode=mode), low)
        assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32, mode


def test_invalid_arguments():
    inputs = make_inputs(5, 1, 4, 2)
    with pytest.raises(ValueError, match="mode=.*expected one of"):
        rglru(**inputs, mode="chunk")
    with pytest.raises(ValueError, match="impl='pallas' has no kernel"):
        rglru(**inputs, impl="pallas")
    with pytest.raises(ValueError, match="a_param"), unchecked():  # the op's own check
        rglru(**{**inputs, "a_param": inputs["a_param"][:1]})
