"""Shared test helpers."""

import jax
import jax.numpy as jnp
import numpy as np


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: the error measure every op test uses (float32 target: < 1e-4)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def assert_close(a, b, tol=1e-4, what=""):
    err = rel_err(a, b)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def assert_tree_close(a, b, tol=1e-4, what=""):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        assert_close(x, y, tol, f"{what}{jax.tree_util.keystr(path)}")


def randn(key, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key) if isinstance(key, int) else key, shape)).astype(dtype)
