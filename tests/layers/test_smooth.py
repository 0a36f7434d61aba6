"""Input-channel scales (layers/smooth.py): the rewrite x W = (x / s)(diag(s) W) is exact in float with
power-of-two scales; AWQ's objective is the output error it names and its search never does worse than
round-to-nearest (alpha = 0), and better on inputs with outlier channels; SmoothQuant's W8A8 product errs
less than plain W8A8 on such inputs; bad input is named."""

import jax.numpy as jnp
import numpy as np
import pytest

from layers.gptq import hessian
from layers.linear import project
from layers.quant import absmax_quantize, dequantize_codes, quantize_weight
from layers.smooth import awq_scales, power_of_two, rtn_error, scaled, smoothquant_scales


def _outliers(seed, N=256, In=64, Out=48):
    """Inputs with a few outlier channels (as LLM activations have: Dettmers et al. 2022), and a weight."""
    rng = np.random.default_rng(seed)
    gain = np.where(rng.random(In) < 0.08, 30.0, 1.0) * rng.uniform(0.5, 1.5, In)
    x = rng.standard_normal((N, In)) * gain
    return x.astype(np.float32), (rng.standard_normal((In, Out)) / np.sqrt(In)).astype(np.float32)


def test_scaling_by_powers_of_two_is_an_exact_rewrite():
    """The migrated float weight gives the original products bit for bit, for a 3-axis weight too."""
    x, w = _outliers(0)
    s = smoothquant_scales(jnp.asarray(w), jnp.abs(jnp.asarray(x)).max(0))
    assert bool(jnp.all(jnp.log2(s) == jnp.round(jnp.log2(s)))) and float(s.max() / s.min()) > 4
    x, w = jnp.asarray(x), jnp.asarray(w)
    np.testing.assert_array_equal(np.asarray(project(x, scaled(w, s))), np.asarray(project(x, w)))
    w3 = w.reshape(64, 6, 8)  # (D, H, K), as attention's wq
    held = scaled(w3, s)
    assert held.shape == w3.shape and np.array_equal(np.asarray(held[:2]), np.asarray(w3[:2]))
    np.testing.assert_array_equal(np.asarray(project(x, held)), np.asarray(project(x, w3)))
    assert float(power_of_two(jnp.array([0.0, 3.0, jnp.inf]))[0]) == 1.0


def test_awq_objective_is_the_output_error_and_its_search_never_loses_to_round_to_nearest():
    x, w = _outliers(1)
    h, wj = hessian(jnp.asarray(x)), jnp.asarray(w)
    s = awq_scales(wj, h, jnp.abs(jnp.asarray(x)).mean(0), "int4", 16)
    codes, scale = absmax_quantize(wj * s[:, None], "int4", 16)
    direct = np.sum((x @ w - (x / np.asarray(s)) @ np.asarray(dequantize_codes(codes, scale))) ** 2)
    assert float(rtn_error(wj, h, s, "int4", 16)) == pytest.approx(direct, rel=1e-3)
    ones = jnp.ones(64)
    for bits, group in (("int4", 16), ("int4", 32), ("int8", None)):
        s = awq_scales(wj, h, jnp.abs(jnp.asarray(x)).mean(0), bits, group)
        assert float(rtn_error(wj, h, s, bits, group)) <= float(rtn_error(wj, h, ones, bits, group))
    assert float(rtn_error(wj, h, awq_scales(wj, h, jnp.abs(jnp.asarray(x)).mean(0), "int4", 16), "int4", 16)) \
        < 0.8 * float(rtn_error(wj, h, ones, "int4", 16))  # outlier channels: the scales pay


def test_smoothquant_w8a8_errs_less_than_plain_w8a8_on_outlier_channels():
    x, w = _outliers(2)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    int8 = lambda m: quantize_weight(m, "int8", dot="int8")  # noqa: E731
    plain = project(xj, int8(wj))
    smooth = project(xj, scaled(wj, smoothquant_scales(wj, jnp.abs(xj).max(0)), quantize=int8))
    err = lambda y: float(jnp.sum((y - x @ w) ** 2))  # noqa: E731
    assert err(smooth) < 0.5 * err(plain), (err(smooth), err(plain))


def test_bad_alpha_is_named():
    with pytest.raises(ValueError, match=r"alpha=1.5; expected a number in \[0, 1\]"):
        smoothquant_scales(jnp.ones((4, 4)), jnp.ones(4), alpha=1.5)
