"""GPTQ (layers/gptq.py) against a direct NumPy implementation of the algorithm, row by row in float64:
the same codes and scales, with and without act order, for int8, grouped int4 and int3; a lower output
error than round-to-nearest on correlated inputs; with uncorrelated inputs of equal energy (H a multiple
of I) nothing is corrected and GPTQ is round-to-nearest exactly; a pruned weight's zeros stay zero;
the codes decode through `Quantized`; bad input names what was wrong."""

import jax.numpy as jnp
import numpy as np
import pytest

from layers.gptq import QMAX, gptq_quantize, hessian
from layers.quant import Quantized, absmax_quantize, dequantize_codes
from tests.util import unchecked


def reference(w, h, bits, group_size, act_order, damp=0.01):
    """GPTQ as the paper's Algorithm 1 reads (no lazy batches), in float64 NumPy; scales rounded to the
    layout's dtype (bfloat16 for int4 storage) through JAX."""
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    kept = w != 0  # SparseGPT's mask: a pruned weight's zeros stay zero
    In, Out = w.shape
    g = group_size or In
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(In)
    rnd = lambda s: np.asarray(jnp.asarray(s, jnp.float32).astype(jnp.float32 if bits == "int8" else jnp.bfloat16)
                               .astype(jnp.float32), np.float64)
    scale_of = lambda rows: rnd(np.abs(rows).max(0) / QMAX[bits])
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(In)
    static = [scale_of(w[j * g:(j + 1) * g]) for j in range(In // g)]
    u = np.linalg.cholesky(np.linalg.inv(h[np.ix_(order, order)])).T
    w, kept = w[order], kept[order]
    codes, scales = np.zeros((In, Out)), np.zeros((In // g, Out))
    for i, r in enumerate(order):
        if act_order:
            s = static[r // g]
        elif r % g == 0:
            s = scale_of(w[i:i + g] * kept[i:i + g])
        else:
            s = scales[r // g]
        q = np.clip(np.round(w[i] / np.where(s > 0, s, 1)), -QMAX[bits], QMAX[bits]) * kept[i]
        err = (w[i] - q * s) / u[i, i]
        w[i + 1:] -= np.outer(u[i, i + 1:], err)
        codes[r], scales[r // g] = q, s
    return codes, scales


def _calibration(seed, N=256, In=64, Out=24):
    """Inputs with correlated channels of unequal energy (as a projection's inputs are), and a weight."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((In, In)) * np.linspace(0.2, 2.0, In)[:, None]
    x = rng.standard_normal((N, In)) @ mix
    return x.astype(np.float32), (rng.standard_normal((In, Out)) / np.sqrt(In)).astype(np.float32)


def _error(x, w, codes, scales):
    return float(np.sum((x @ w - x @ np.asarray(dequantize_codes(jnp.asarray(codes), jnp.asarray(scales)))) ** 2))


@pytest.mark.parametrize("bits, group_size, act_order", [("int8", None, False), ("int4", 16, False),
                                                         ("int4", 32, True), ("int3", 16, True)])
def test_matches_the_algorithm_and_beats_round_to_nearest(bits, group_size, act_order):
    x, w = _calibration(seed=len(bits) + (group_size or 0))
    h = hessian(jnp.asarray(x))
    codes, scales = gptq_quantize(jnp.asarray(w), h, bits, group_size=group_size, act_order=act_order)
    want_codes, want_scales = reference(w, np.asarray(h), bits, group_size, act_order)
    np.testing.assert_allclose(np.asarray(scales, np.float64), want_scales, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(codes, np.int32), want_codes.astype(np.int32))
    assert np.abs(np.asarray(codes, np.int32)).max() <= QMAX[bits]

    rtn = absmax_quantize(jnp.asarray(w), "int8" if bits == "int8" else "int4", group_size)
    if bits != "int3":  # round-to-nearest has no int3 form; GPTQ's int3 against its own int4 below
        assert _error(x, w, codes, scales) < 0.7 * _error(x, w, *rtn), (bits, group_size)
    else:
        assert _error(x, w, codes, scales) > _error(x, w, *gptq_quantize(jnp.asarray(w), h, "int4", group_size=16))


@pytest.mark.parametrize("act_order", [False, True])
def test_a_pruned_weight_keeps_its_zeros(act_order):
    """Prune then quantize (SparseGPT's joint mode): the 2:4 pattern of the pruned weight survives in the
    codes, the codes are the algorithm's with that mask, and the error is below rounding the pruned weight."""
    from layers.prune import prune_weight

    x, w = _calibration(seed=6)
    h = hessian(jnp.asarray(x))
    pruned = np.asarray(prune_weight(jnp.asarray(w), h, "sparsegpt", sparsity=None, n_of_m=(2, 4)))
    codes, scales = gptq_quantize(jnp.asarray(pruned), h, "int4", group_size=16, act_order=act_order)
    want_codes, want_scales = reference(pruned, np.asarray(h), "int4", 16, act_order)
    np.testing.assert_array_equal(np.asarray(codes, np.int32), want_codes.astype(np.int32))
    np.testing.assert_allclose(np.asarray(scales, np.float64), want_scales, rtol=1e-6)
    assert not np.asarray(codes)[pruned == 0].any() and (pruned == 0).sum() == w.size // 2
    assert _error(x, pruned, codes, scales) < 0.8 * _error(x, pruned, *absmax_quantize(jnp.asarray(pruned), "int4", 16))


def test_with_uncorrelated_inputs_of_equal_energy_it_is_round_to_nearest():
    """H = c I: the inverse Hessian is diagonal, so no error moves to another row."""
    _, w = _calibration(seed=3)
    for bits, group in (("int8", None), ("int4", 32)):
        codes, scales = gptq_quantize(jnp.asarray(w), 5.0 * jnp.eye(64), bits, group_size=group)
        rtn_codes, rtn_scales = absmax_quantize(jnp.asarray(w), bits, group)
        np.testing.assert_array_equal(np.asarray(codes, np.int32), np.asarray(rtn_codes, np.int32))
        np.testing.assert_array_equal(np.asarray(scales, np.float32), np.asarray(rtn_scales, np.float32))


def test_codes_decode_through_quantized_and_dead_inputs_are_zeroed():
    x, w = _calibration(seed=4)
    x[:, 5] = 0  # an input that never fires
    codes, scales = gptq_quantize(jnp.asarray(w), hessian(jnp.asarray(x)), "int4", group_size=16)
    assert not np.asarray(codes, np.int32)[5].any()
    q = Quantized(values=codes, scale=scales, shape=w.shape)
    np.testing.assert_allclose(np.asarray(q.dequantize()), np.asarray(dequantize_codes(codes, scales)), rtol=0)
    np.testing.assert_allclose(np.asarray(jnp.asarray(x) @ q.dequantize()), x @ w, atol=0.15 * np.abs(x @ w).max())


def test_bad_input_is_named():
    x, w = _calibration(seed=5)
    h = hessian(jnp.asarray(x))
    with pytest.raises(ValueError, match=r"bits='int2'; expected one of \('int8', 'int4', 'int3'\)"):
        gptq_quantize(jnp.asarray(w), h, "int2")
    with pytest.raises(ValueError, match="group_size=24 does not divide the input width 64"):
        gptq_quantize(jnp.asarray(w), h, "int4", group_size=24)
    with pytest.raises(ValueError, match=r"the Hessian is \(24, 24\); expected \(64, 64\)"), unchecked():
        gptq_quantize(jnp.asarray(w), jnp.eye(24), "int4")
