"""Low-rank factorization (layers/factor.py, infer/factorize.py): at full rank both variants rewrite the
weight exactly (to float32 rounding); at rank r the plain error ||W - A B||_F and the whitened output error
||X (W - A B)||_F are the discarded singular values' norm (of W, of S^T W), and the whitened variant's
output error is below the plain one's; a factored model of every projection decodes like its own full
pass, its held-out error falls as the rank grows; ranks allocated by the spectra keep the parameter count
and lose the least share of the projections' energy (the brute-force optimum at equal costs); bad input
named."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
from infer.factorize import rank_allocation, spectra
from infer.quantize import matrices
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


def test_rank_allocation_keeps_the_most_energy_within_the_budget():
    steep, flat = np.array([10.0, 1.0, 0.5, 0.1]), np.array([10.0, 9.0, 8.0, 7.0])
    assert rank_allocation([steep, flat], [8, 8], 4 * 8) == [1, 3]
    rng = np.random.default_rng(0)
    for _ in range(20):  # equal costs: greedy is the optimum, checked against every allocation
        spectra = [np.sort(rng.exponential(size=4))[::-1] for _ in range(3)]
        budget = int(rng.integers(3, 13))
        ranks = rank_allocation(spectra, [1, 1, 1], budget)
        assert sum(ranks) <= budget and min(ranks) >= 1
        lost = lambda rs: sum(float(np.sum(s[r:] ** 2)) for s, r in zip(spectra, rs))
        best = min(lost(rs) for rs in itertools.product(range(1, 5), repeat=3) if sum(rs) <= budget)
        assert lost(ranks) == pytest.approx(best)
    costs = [3, 5, 11]  # unequal costs: within the budget, rank 1 at least
    ranks = rank_allocation([np.sort(rng.exponential(size=6))[::-1] for _ in costs], costs, 60)
    assert sum(r * c for r, c in zip(ranks, costs)) <= 60 and min(ranks) >= 1


def test_ranks_from_the_spectra_spend_the_uniform_parameters_and_discard_less():
    model = tiny_model({"kind": "gla", "num_heads": 2}, d_model=64, num_layers=2)
    cal = jax.random.randint(jax.random.key(0), (8, 48), 0, 256)
    sigmas = [np.asarray(svd[1]) for *_, svd in spectra(model, cal)]  # whitened, as factorize reads them
    shares = [s ** 2 / np.sum(s ** 2) for s in sigmas]

    def factors(q):
        held = [getattr(m, n).get_value() for m, n, *_ in matrices(q) if hasattr(getattr(m, n).get_value(), "a")]
        return [h.a.shape[1] for h in held], sum(h.a.size + h.b.size for h in held)

    uniform, spread = (infer.factorize(model, 0.5, calibration=cal, allocate=a) for a in ("uniform", "spectrum"))
    (ranks_u, size_u), (ranks_s, size_s) = factors(uniform), factors(spread)
    assert size_s <= size_u and size_s > 0.95 * size_u and ranks_s != ranks_u
    lost = lambda ranks: sum(float(np.sum(share[r:])) for share, r in zip(shares, ranks))
    assert lost(ranks_s) < 0.9 * lost(ranks_u)  # the shares of their output energy the projections lose


def test_bad_input_is_named():
    _, w = _calibration(seed=12)
    with pytest.raises(ValueError, match="rank=25; expected 1 to 24 for a weight 64 x 24"):
        factorize(jnp.asarray(w), 25)
    with pytest.raises(ValueError, match=r"rank_fraction=0; expected a fraction in \(0, 1\]"):
        infer.factorize(tiny_model({"kind": "gla", "num_heads": 2}), 0)
    with pytest.raises(ValueError, match=r"allocate='greedy'; expected one of \('uniform', 'spectrum'\)"):
        infer.factorize(tiny_model({"kind": "gla", "num_heads": 2}), 0.5, allocate="greedy")
