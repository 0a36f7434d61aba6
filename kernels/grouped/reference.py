"""The grouped product written out: each row times its group's matrix (kernels/grouped/__init__.py)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def grouped_matmul_reference(x: Float[Array, "M K"], w: Float[Array, "E K N"],
                             group_sizes: Int[Array, " E"]) -> Float[Array, "M N"]:
    """y[i] = x[i] @ w[e] for the rows i of group e, the groups' rows one after the other; 0 past their total."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # (M,): E past the total
    y = jnp.einsum("mk,mkn->mn", x, w[jnp.minimum(group, w.shape[0] - 1)])
    return jnp.where((group < w.shape[0])[:, None], y, 0.0)
