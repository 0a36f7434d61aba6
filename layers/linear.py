"""Matrix products the way XLA on CPU differentiates fastest: the leading dimensions of the input
flattened into one, so every projection is one 2-D product.

A `dot_general` of a (B, T, D) input with a (D, H, K) weight computes the same numbers, but on CPU
its backward is much slower: B=8, T=256, D=128, H=4, K=32, an attention block's forward+backward
took 28.7 ms with 3-D operands and 18.8 ms with these, a SwiGLU MLP's 12.1 and 7.4 ms
(benchmarks/peers.py measures the whole model).
"""

import jax
from flax import nnx


def project(x: jax.Array, w: jax.Array, **dot_kwargs) -> jax.Array:
    """x (..., D) @ w (D, *out) -> (..., *out), as one (N, D) @ (D, prod(out)) product."""
    lead, out = x.shape[:-1], w.shape[1:]
    y = jax.lax.dot(x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1), **dot_kwargs)
    return y.reshape(*lead, *out)


class Linear(nnx.Linear):
    """nnx.Linear over flattened leading dimensions (the same parameters and function)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
