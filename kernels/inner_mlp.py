"""The two-layer MLP inner model of the test-time-training ops (kernels/ttt's TTT-MLP, kernels/titans' deep
memory): its forward pass, its backward pass written out, and the dual-form read of a layer whose weights moved
by a sum of rank-one gradient terms. Rows are the last-but-one axis: x (..., C, K), W (..., K, F), b (..., F) or
None (titans' memory has no biases).

    Z1 = x W1 + b1,   X2 = gelu(Z1),   Z2 = X2 W2 + b2
    given dl/dZ2:  dl/dZ1 = (dl/dZ2 W2^T) * gelu'(Z1),   grad_W1 = x^T dl/dZ1,  grad_b1 = dl/dZ1,
                   grad_W2 = X2^T dl/dZ2,  grad_b2 = dl/dZ2

The dual read: a row x_i read through weights W_i = W_a - sum_j P[i, j] X_j^T dZ_j (b_i = b_a - sum_j P[i, j]
dZ_j, with a bias) is x_i W_a + b_a - sum_j P[i, j] (x_i . X_j + 1) dZ_j: a C x C matrix instead of a K x F
one per row. `exact` picks the erf GELU (PyTorch's default, titans-pytorch) or the tanh approximation (flax's
and jax's default, the official TTT code).
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

TANH_C = math.sqrt(2 / math.pi)  # the tanh approximation's constant
CUBIC = 0.044715


def gelu(x: Array, exact: bool) -> Array:
    return jax.nn.gelu(x, approximate=not exact)


def gelu_grad(x: Array, exact: bool) -> Array:
    """d gelu / dx, written out (so that the outer gradient is one more derivative, not a nested vjp)."""
    if exact:
        return 0.5 * (1 + jax.lax.erf(x / math.sqrt(2))) + x * jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    t = jnp.tanh(TANH_C * (x + CUBIC * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * TANH_C * (1 + 3 * CUBIC * x * x)


def affine(x: Float[Array, "*X C K"], W: Float[Array, "*W K F"], b: Float[Array, "*W F"] | None):
    """x W + b, rows of x: (..., C, F), the leading axes broadcast (W may hold several sets of weights)."""
    z = x @ W
    return z if b is None else z + b[..., None, :]


def forward(x: Float[Array, "*X C K"], params: tuple, exact: bool):
    """(Z1, Z2) of the MLP params = (W1, b1, W2, b2) on the rows x."""
    W1, b1, W2, b2 = params
    Z1 = affine(x, W1, b1)
    return Z1, affine(gelu(Z1, exact), W2, b2)


def backward(dZ2: Float[Array, "*X C K"], Z1: Float[Array, "*X C F"], W2: Float[Array, "*W F K"], exact: bool):
    """dl/dZ1 from dl/dZ2 (module docstring)."""
    return (dZ2 @ jnp.swapaxes(W2, -1, -2)) * gelu_grad(Z1, exact)


def weighted_grads(w: Float[Array, "*B C"], x: Float[Array, "*B C K"], Z1, dZ1, dZ2, params: tuple, exact: bool):
    """sum_c w_c grad l_c for each of params = (W1, b1, W2, b2) (None where params has None): the gradient
    sums of the rows, each row's loss weighted by w_c."""
    outer = lambda a, d: jnp.swapaxes(a * w[..., None], -1, -2) @ d  # sum_c w_c a_c^T d_c
    bias = lambda d, b: None if b is None else jnp.sum(w[..., None] * d, axis=-2)
    return outer(x, dZ1), bias(dZ1, params[1]), outer(gelu(Z1, exact), dZ2), bias(dZ2, params[3])


def dual_read(x: Float[Array, "*B C K"], X: Float[Array, "*B C K"], dZ: Float[Array, "*B C F"],
              P: Float[Array, "*B C C"], base: Float[Array, "*B C F"], bias: bool):
    """base_i - sum_j P[i, j] (x_i . X_j [+ 1 with a bias]) dZ_j: rows x read through weights that moved by
    -sum_j P[i, j] X_j^T dZ_j from those that gave `base` (module docstring)."""
    A = x @ jnp.swapaxes(X, -1, -2)  # (..., C, C)
    return base - ((A + 1 if bias else A) * P) @ dZ
