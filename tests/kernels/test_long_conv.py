"""Long convolution op: the FFT form against the masked-dense reference (outputs and gradients w.r.t.
u and the filter), the reference against a loop over the definition, packed documents, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.long_conv import long_conv
from tests.util import assert_close, unchecked


def randn(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@jax.jit
def grads(u, k, w):
    """Outputs and gradients of both forms, one compile."""
    def loss(u, k, impl):
        y = long_conv(u, k, impl=impl)
        return jnp.sum(y * w), y
    return [jax.grad(loss, argnums=(0, 1), has_aux=True)(u, k, impl) for impl in ("reference", "xla")]


@pytest.mark.parametrize("T", [1, 37])
def test_fft_matches_reference(T):
    u, k, w = randn(0, 2, T, 3), randn(1, T, 3), randn(2, 2, T, 3)
    (g_ref, y_ref), (g, y) = grads(u, k, w)
    assert_close(y, y_ref, what="y")
    for name, a, b in zip(("du", "dk"), g, g_ref, strict=True):
        assert_close(a, b, what=name)


def test_reference_matches_the_definition_within_documents():
    u, k = randn(3, 1, 7, 2), randn(4, 7, 2)
    seg = jnp.asarray([[0, 0, 0, 1, 1, 2, 2]], jnp.int32)
    y = long_conv(u, k, segment_ids=seg)
    doc, u, k = np.asarray(seg)[0], np.asarray(u, np.float64)[0], np.asarray(k, np.float64)
    want = np.array([sum(k[t - s] * u[s] for s in range(t + 1) if doc[s] == doc[t]) for t in range(7)])
    assert_close(np.asarray(y)[0], want, what="y")


def test_bad_arguments_are_named():
    with unchecked(), pytest.raises(ValueError, match="expected u"):
        long_conv(randn(0, 1, 5, 2), randn(0, 4, 2))
    with pytest.raises(ValueError, match="impl='pallas'"):
        long_conv(randn(0, 1, 5, 2), randn(0, 5, 2), impl="pallas")
