"""Every form of the Mamba-1 selective scan against the token-by-token reference: outputs, final
state and gradients w.r.t. every input (x, Δ, A, B, C, D, initial_state), with document resets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import MODES
from kernels.selective_scan import selective_scan
from tests.util import assert_close, unchecked

scan = jax.jit(selective_scan, static_argnames=("output_final_state", "mode", "chunk_size", "impl"))


def make_inputs(seed, Bsz, T, Dm, N):
    """Random inputs, drawn with numpy (no XLA compile per shape). Δ reaches a few units and A down
    to -16, so strong decays occur."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return dict(
        x=f(Bsz, T, Dm),
        delta=jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, Dm)) + 0.5)), jnp.float32),
        A=jnp.asarray(-np.exp(rng.uniform(-1.0, np.log(16.0), (Dm, N))), jnp.float32),
        B=f(Bsz, T, N),
        C=f(Bsz, T, N),
        D=f(Dm),
        initial_state=f(Bsz, Dm, N),
    )


@functools.cache
def outputs_and_grads(mode, chunk_size, impl="xla"):
    """jit(inputs, segment_ids, weights) -> ((y, h_T), grads of a random projection of both)."""

    def loss(inputs, segment_ids, wy, wh):
        y, h = selective_scan(**inputs, segment_ids=segment_ids, output_final_state=True, mode=mode,
                              chunk_size=chunk_size, impl=impl)
        return jnp.sum(y * wy) + jnp.sum(h * wh), (y, h)

    return jax.jit(jax.grad(loss, has_aux=True))


CASES = [  # (B, T, Dm, N, chunk_size, segment rows or None)
    (2, 63, 8, 4, 16, [[0] * 20 + [1] * 12 + [2] * 31, [5] + [6] * 62]),  # starts at 20, 32 = a chunk edge, 1
    (1, 1, 3, 2, 16, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}Dm{c[2]}N{c[3]}C{c[4]}")
def test_modes_match_reference(case):
    Bsz, T, Dm, N, chunk, seg = case
    inputs = make_inputs(T, Bsz, T, Dm, N)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    rng = np.random.default_rng(1)
    wy, wh = rng.standard_normal((Bsz, T, Dm)), rng.standard_normal((Bsz, Dm, N))
    ref_grads, (ref_y, ref_h) = outputs_and_grads("recurrent", chunk, "reference")(inputs, seg, wy, wh)
    for mode in MODES:  # "recurrent": the scan with the hand-written backward (recurrent.py)
        grads, (y, h) = outputs_and_grads(mode, chunk)(inputs, seg, wy, wh)
        assert_close(y, ref_y, what=f"{mode} y")
        assert_close(h, ref_h, what=f"{mode} final state")
        for name in inputs:
            assert np.all(np.isfinite(grads[name])), f"{mode} d/d{name} not finite"
            assert_close(grads[name], ref_grads[name], what=f"{mode} d/d{name}")


def test_reference_packed_row_equals_documents_alone():
    """The reset rule on the reference; every other form matches the reference with segment_ids above."""
    lengths = (9, 1, 14)  # a one-token document too
    T = sum(lengths)
    inputs = make_inputs(3, 1, T, 4, 3)
    seg = jnp.asarray([sum([[i] * n for i, n in enumerate(lengths)], [])], jnp.int32)
    y, h = scan(**inputs, segment_ids=seg, output_final_state=True, mode="recurrent")
    t0 = 0
    for i, n in enumerate(lengths):
        doc = {k: v[:, t0:t0 + n] if k in ("x", "delta", "B", "C") else v for k, v in inputs.items()}
        if i > 0:  # only the first document continues the initial state
            doc["initial_state"] = None
        y_doc, h_doc = scan(**doc, output_final_state=True, mode="recurrent")
        assert_close(y[:, t0:t0 + n], y_doc, what=f"document {i}")
        t0 += n
    assert_close(h, h_doc, what="final state = last document's")


def test_bfloat16_inputs_give_bfloat16_outputs_and_a_float32_state():
    low = {k: v.astype(jnp.bfloat16) for k, v in make_inputs(4, 1, 20, 4, 3).items()}
    for mode in MODES:  # abstract evaluation: dtypes without a compile
        y, h = jax.eval_shape(lambda i: selective_scan(**i, output_final_state=True, mode=mode, chunk_size=8), low)
        assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32, mode


def test_invalid_arguments():
    inputs = make_inputs(5, 1, 4, 2, 2)
    with pytest.raises(ValueError, match="mode=.*expected one of"):
        selective_scan(**inputs, mode="fused")
    with pytest.raises(ValueError, match="impl=.*expected one of"):
        selective_scan(**inputs, impl="triton")
    with pytest.raises(ValueError, match="A"), unchecked():  # the op's own check
        selective_scan(**{**inputs, "A": inputs["A"][:1]})
