"""The grouped product's CPU kernels (kernels/grouped/cpu.cc) against the reference: the output and the
gradients of x and w, with empty groups, groups longer than a 64-row chunk and ending inside one, rows past
the groups' total, and K and N that are padded (20, 40) or not (32, 48)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.grouped import grouped_matmul, grouped_matmul_reference, supports
from tests.util import NEEDS_CXX, assert_close


@NEEDS_CXX
@pytest.mark.parametrize("M, K, N, sizes", [(300, 20, 40, (0, 150, 7, 0, 130)), (97, 32, 48, (33, 0, 16, 17))])
def test_matches_reference(M, K, N, sizes):
    rng = np.random.default_rng(0)
    x, w, dy = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((M, K), (len(sizes), K, N), (M, N)))
    sizes = jnp.asarray(sizes, jnp.int32)
    assert supports(x, w)

    def out_and_grads(f):
        y, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
        return (y, *vjp(dy))

    got = jax.jit(lambda: out_and_grads(grouped_matmul))()
    want = out_and_grads(grouped_matmul_reference)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert_close(a, b, 1e-5, name)
    assert float(jnp.abs(got[0][int(sizes.sum()):]).max()) == 0.0  # rows past the total


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="grouped_matmul: expected"):
        grouped_matmul(jnp.ones((4, 8)), jnp.ones((2, 16, 8)), jnp.array([2, 2]))
