"""Pruning one projection (layers/prune.py): every method hits the asked sparsity in every output
column exactly, and the n:m pattern in every group; SparseGPT equals a direct float64 NumPy run of the
algorithm and its calibration error is below magnitude pruning's, as is Wanda's on inputs of unequal
energy; sparsity 0 leaves the weight as it was; bad input names what was wrong."""

import jax.numpy as jnp
import numpy as np
import pytest

from layers.gptq import hessian
from layers.prune import prune_weight
from tests.layers.test_gptq import _calibration


def reference_sparsegpt(w, h, sparsity, n_of_m, block, damp=0.01):
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    In, Out = w.shape
    h += damp * np.mean(np.diag(h)) * np.eye(In)
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    pruned = np.zeros((In, Out), bool)
    for i in range(In):
        if i % block == 0:
            sal = w[i:i + block] ** 2 / np.diag(u)[i:i + block, None] ** 2
            groups = [(a, a + block) for a in [0]] if n_of_m is None else \
                [(a, a + n_of_m[1]) for a in range(0, block, n_of_m[1])]
            k = round(sparsity * block) if n_of_m is None else n_of_m[0]
            for a, b in groups:
                order = np.argsort(sal[a:b], axis=0, kind="stable")
                for col in range(Out):
                    pruned[i + a + order[:k, col], col] = True
        q = np.where(pruned[i], 0.0, w[i])
        err = (w[i] - q) / u[i, i]
        w[i + 1:] -= np.outer(u[i, i + 1:], err)
        w[i] = q
    return w


def _error(x, w, p):
    return float(np.sum((x @ (np.asarray(p, np.float64) - w)) ** 2))


@pytest.mark.parametrize("sparsity, n_of_m", [(0.5, None), (None, (2, 4))])
def test_every_method_prunes_exactly_and_sparsegpt_errs_least(sparsity, n_of_m):
    x, w = _calibration(seed=7)
    h = hessian(jnp.asarray(x))
    got = {m: np.asarray(prune_weight(jnp.asarray(w), h, m, sparsity=sparsity, n_of_m=n_of_m, block=32))
           for m in ("magnitude", "wanda", "sparsegpt")}
    for method, p in got.items():
        zero = p == 0
        if n_of_m is None:
            assert (zero.sum(0) == 32).all(), method  # half of 64 inputs, every column
        else:
            assert (zero.reshape(16, 4, -1).sum(1) == 2).all(), method  # 2 of every 4 consecutive inputs
    np.testing.assert_allclose(got["sparsegpt"], reference_sparsegpt(w, np.asarray(h), sparsity, n_of_m, 32),
                               rtol=1e-4, atol=1e-5)
    errors = {m: _error(x, w, p) for m, p in got.items()}
    assert errors["sparsegpt"] < 0.7 * errors["magnitude"] and errors["wanda"] < errors["magnitude"], errors


def test_sparsity_zero_is_the_weight():
    x, w = _calibration(seed=8)
    np.testing.assert_array_equal(np.asarray(prune_weight(jnp.asarray(w), hessian(jnp.asarray(x)), sparsity=0.0)), w)


def test_bad_input_is_named():
    x, w = _calibration(seed=9)
    w, h = jnp.asarray(w), hessian(jnp.asarray(x))
    for kwargs, message in [
        (dict(method="random"), r"method='random'; expected one of \('magnitude', 'wanda', 'sparsegpt'\)"),
        (dict(sparsity=1.0), r"sparsity=1.0; expected a fraction in \[0, 1\)"),
        (dict(n_of_m=(2, 4)), "give sparsity or n_of_m, not both"),
        (dict(sparsity=None, n_of_m=(4, 4)), r"n_of_m=\(4, 4\); expected 0 < n < m with m dividing the input width 64"),
        (dict(block=24), "block=24 does not divide the input width 64"),
    ]:
        with pytest.raises(ValueError, match=message):
            prune_weight(w, h, **kwargs)
    with pytest.raises(ValueError, match=r"wanda needs the inputs' Hessian \(64, 64\); got None"):
        prune_weight(w, None, "wanda")
