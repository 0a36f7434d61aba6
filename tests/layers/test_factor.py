"""Low-rank factorization (layers/factor.py, infer/factorize.py): at full rank both variants rewrite the
weight exactly (to float32 rounding); at rank r the plain error ||W - A B||_F and the whitened output error
||X (W - A B)||_F are the discarded singular values' norm (of W, of S^T W), and the whitened variant's
output error is below the plain one's; a factored model of every projection decodes like its own full
pass, its held-out error falls as the rank grows; bad input named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
from layers.factor import factorize
from layers.gptq import hessian
from tests.layers.test_gptq import _calibration
from tests.util import decode_in_pieces, forward, rel_err, tiny_model


def test_full_rank_is_the_weight_and_rank_r_errs_by_the_discarded_singular_values():
    x, w = _calibration(seed=11)  # (256, 64) inputs, (64, 24) weight
    h = hessian(jnp.asarray(x))
    for hh in (None, h):
        a, b = factorize(jnp.asarray(w), 24, hh)
        np.testing.assert_allclose(np.asarray(a @ b), w, atol=2e-5)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    sigma = np.linalg.svd(w64, compute_uv=False)
    a, b = factorize(jnp.asarray(w), 8)
    np.testing.assert_allclose(np.linalg.norm(w64 - np.asarray(a @ b, np.float64)), np.linalg.norm(sigma[8:]),
                               rtol=1e-4)
    s = np.linalg.cholesky(x64.T @ x64)
    sigma_white = np.linalg.svd(s.T @ w64, compute_uv=False)
    aw, bw = factorize(jnp.asarray(w), 8, h)
    white_err = np.linalg.norm(x64 @ (w64 - np.asarray(aw @ bw, np.float64)))
    np.testing.assert_allclose(white_err, np.linalg.norm(sigma_white[8:]), rtol=1e-3)
    assert white_err < 0.8 * np.linalg.norm(x64 @ (w64 - np.asarray(a @ b, np.float64)))


def test_a_factored_model_decodes_like_its_full_pass_and_errs_less_at_higher_rank():
    model = tiny_model({"kind": "gla", "num_heads": 2}, d_model=64, num_layers=2)
    cal, test = (jax.random.randint(k, (8, 48), 0, 256) for k in jax.random.split(jax.random.key(0)))
    ref = forward(model, test)
    err = lambda q: float(jnp.mean((forward(q, test) - ref) ** 2))
    full = infer.factorize(model, 1.0)
    assert err(full) < 1e-8
    errors = [err(infer.factorize(model, f, calibration=cal)) for f in (0.25, 0.5, 0.75)]
    assert errors[0] > errors[1] > errors[2] > 0, errors
    half = infer.factorize(model, 0.5, calibration=cal)
    assert half.blocks[0].mixer.q_proj.kernel.get_value().a.shape == (64, 16)  # q_proj is 64 x 32
    pieces, _ = decode_in_pieces(half, test, cuts=[17, 30, 31])
    assert rel_err(pieces, forward(half, test)) < 1e-4


def test_bad_input_is_named():
    _, w = _calibration(seed=12)
    with pytest.raises(ValueError, match="rank=25; expected 1 to 24 for a weight 64 x 24"):
        factorize(jnp.asarray(w), 25)
    with pytest.raises(ValueError, match=r"rank_fraction=0; expected a fraction in \(0, 1\]"):
        infer.factorize(tiny_model({"kind": "gla", "num_heads": 2}), 0)
