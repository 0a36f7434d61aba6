"""Every form of Mamba-2's SSD against the token-by-token reference: outputs, final state and
gradients w.r.t. every input (x, dt, A, B, C, D, initial_state), groups G = 1 and G = H, with
document resets; the chunked form both as XLA's einsums and through the CPU kernels (kernels/ssd/cpu.cc,
which impl "auto" takes on CPU); and the SSD reference against the Mamba-1 selective-scan reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import MODES
from kernels.selective_scan import selective_scan
from kernels.ssd import ssd
from tests.util import NEEDS_CXX, assert_close

run = jax.jit(ssd, static_argnames=("output_final_state", "mode", "chunk_size", "impl"))


def make_inputs(seed, Bsz, T, H, P, G, N):
    """Random inputs, drawn with numpy (no XLA compile per shape). dt is about 1 and A spans
    [-16, -e^-1], so a chunk's log-decay passes -88 in the last head: exp of the masked upper
    triangle would overflow there."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return dict(
        x=f(Bsz, T, H, P),
        dt=jnp.asarray(np.log1p(np.exp(rng.standard_normal((Bsz, T, H)) + 0.5)), jnp.float32),
        A=jnp.asarray(-np.exp(np.linspace(-1.0, np.log(16.0), H)), jnp.float32),
        B=f(Bsz, T, G, N),
        C=f(Bsz, T, G, N),
        D=f(H),
        initial_state=f(Bsz, H, P, N),
    )


@functools.cache
def outputs_and_grads(mode, chunk_size, impl="xla"):
    """jit(inputs, segment_ids, weights) -> ((y, h_T), grads of a random projection of both)."""

    def loss(inputs, segment_ids, wy, wh):
        y, h = ssd(**inputs, segment_ids=segment_ids, output_final_state=True, mode=mode, chunk_size=chunk_size,
                   impl=impl)
        return jnp.sum(y * wy) + jnp.sum(h * wh), (y, h)

    return jax.jit(jax.grad(loss, has_aux=True))


CASES = [  # (B, T, H, P, G, N, chunk_size, segment rows or None)
    (2, 63, 2, 4, 1, 4, 16, [[0] * 20 + [1] * 12 + [2] * 31, [5] + [6] * 62]),  # starts at 20, 32 = a chunk edge, 1
    (2, 63, 2, 3, 2, 4, 16, [[0] * 40 + [1] * 23, [0] * 63]),
    (1, 1, 2, 2, 2, 3, 16, None),
    (2, 200, 4, 32, 2, 48, 64, [[0] * 100 + [1] * 100, [0] * 150 + [1] * 50]),  # 4 chunks, N and P not padded
]
FORMS = [(mode, "xla") for mode in MODES[1:]] + [("chunk", "auto")]  # auto: the CPU kernels, where they build


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}P{c[3]}G{c[4]}")
def test_modes_match_reference(case):
    Bsz, T, H, P, G, N, chunk, seg = case
    inputs = make_inputs(T + G, Bsz, T, H, P, G, N)
    seg = None if seg is None else jnp.asarray(seg, jnp.int32)
    rng = np.random.default_rng(1)
    wy, wh = rng.standard_normal((Bsz, T, H, P)), rng.standard_normal((Bsz, H, P, N))
    ref_grads, (ref_y, ref_h) = outputs_and_grads("recurrent", chunk)(inputs, seg, wy, wh)
    for mode, impl in FORMS:
        grads, (y, h) = outputs_and_grads(mode, chunk, impl)(inputs, seg, wy, wh)
        mode = f"{mode} {impl}"
        assert_close(y, ref_y, what=f"{mode} y")
        assert_close(h, ref_h, what=f"{mode} final state")
        for name in inputs:
            assert np.all(np.isfinite(grads[name])), f"{mode} d/d{name} not finite"
            assert_close(grads[name], ref_grads[name], what=f"{mode} d/d{name}")


@NEEDS_CXX
def test_auto_takes_the_cpu_kernels_for_the_chunked_form_alone():
    inputs = make_inputs(0, 1, 40, 2, 4, 1, 4)
    hlo = lambda **kw: jax.jit(lambda i: ssd(**i, **kw)).lower(inputs).as_text()
    assert "zoo_ssd_cpu_forward" in hlo()
    for kw in (dict(impl="xla"), dict(mode="parallel"), dict(mode="recurrent"), dict(impl="reference")):
        assert "zoo_ssd_cpu" not in hlo(**kw), kw


def test_reference_packed_row_equals_documents_alone():
    """The reset rule on the reference; every other form matches the reference with segment_ids above."""
    lengths = (9, 1, 14)  # a one-token document too
    inputs = make_inputs(3, 1, sum(lengths), 2, 3, 1, 4)
    seg = jnp.asarray([sum([[i] * n for i, n in enumerate(lengths)], [])], jnp.int32)
    y, h = run(**inputs, segment_ids=seg, output_final_state=True, mode="recurrent")
    t0 = 0
    for i, n in enumerate(lengths):
        doc = {k: v[:, t0:t0 + n] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()}
        if i > 0:  # only the first document continues the initial state
            doc["initial_state"] = None
        y_doc, h_doc = run(**doc, output_final_state=True, mode="recurrent")
        assert_close(y[:, t0:t0 + n], y_doc, what=f"document {i}")
        t0 += n
    assert_close(h, h_doc, what="final state = last document's")


def test_reference_equals_selective_scan_with_tied_decays():
    """SSD is the selective scan with channels d = (h, p), Δ and A tied within a head, A tied over N."""
    Bsz, T, H, P, N = 2, 12, 2, 3, 4
    inp = make_inputs(7, Bsz, T, H, P, 1, N)
    y, h = run(**inp, output_final_state=True, mode="recurrent")
    y1, h1 = jax.jit(selective_scan, static_argnames=("output_final_state", "mode"))(
        inp["x"].reshape(Bsz, T, H * P), jnp.repeat(inp["dt"], P, axis=2),
        jnp.repeat(inp["A"], P)[:, None] * jnp.ones(N),
        inp["B"][:, :, 0], inp["C"][:, :, 0], jnp.repeat(inp["D"], P),
        initial_state=inp["initial_state"].reshape(Bsz, H * P, N), output_final_state=True, mode="recurrent")
    assert_close(y.reshape(Bsz, T, H * P), y1, what="y")
    assert_close(h.reshape(Bsz, H * P, N), h1, what="state")


def test_bfloat16_inputs_give_bfloat16_outputs_and_a_float32_state():
    low = {k: v.astype(jnp.bfloat16) for k, v in make_inputs(4, 1, 20, 2, 3, 1, 4).items()}
    for mode in MODES:  # abstract evaluation: dtypes without a compile
        y, h = jax.eval_shape(lambda i: ssd(**i, output_final_state=True, mode=mode, chunk_size=8), low)
        assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32, mode


def test_invalid_arguments():
    inputs = make_inputs(5, 1, 4, 2, 2, 1, 2)
    with pytest.raises(ValueError, match="mode=.*expected one of"):
        ssd(**inputs, mode="fused")
    with pytest.raises(ValueError, match="impl=.*expected one of"):
        ssd(**inputs, impl="triton")
    with pytest.raises(ValueError, match="G dividing"):
        ssd(**{**inputs, "B": inputs["B"].repeat(3, 2), "C": inputs["C"].repeat(3, 2)})
