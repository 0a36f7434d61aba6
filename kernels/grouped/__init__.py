"""Grouped matrix products, a dropless mixture of experts' products: rows sorted by group, each group's rows
times its own matrix.

    y = grouped_matmul(x (M, K), w (E, K, N), group_sizes (E,))  ->  (M, N)
    y[i] = x[i] @ w[e] for the rows i of group e (group e's sizes[e] rows follow group e-1's); 0 past the total

- reference.py: each row times its group's matrix, written out (the truth the kernels are tested against);
- cpu.cc: on CPU, the products group by group through kernels/native.h's register-blocked product, forward
  and both gradients (dx = grouped_matmul(dy, w^T); dw[e] = x_e^T dy_e), as XLA FFI custom calls built by
  kernels/native.py, for float32 on one CPU device (`supports`). K and N are padded to multiples of 16.

Elsewhere layers/moe.py keeps its tiled XLA form (each group padded to whole tiles, each tile times its
expert's weights): `jax.lax.ragged_dot` on CPU is a masked dense product over every group. Tests:
tests/kernels/test_grouped.py.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels import native
from kernels.grouped.reference import grouped_matmul_reference

SOURCE = Path(__file__).with_name("cpu.cc")
PRODUCT, WEIGHTS = "zoo_grouped_product", "zoo_grouped_weights"


KERNELS = native.Kernels(SOURCE, (("ZooGroupedProduct", PRODUCT), ("ZooGroupedWeights", WEIGHTS)),
                         "layers/moe.py runs its tiled XLA form")


def supports(x, w) -> bool:
    """Whether `grouped_matmul` runs the CPU kernels for these operands."""
    return x.dtype == w.dtype == jnp.float32 and native.on_one_cpu() and KERNELS.available()


def grouped_matmul(x, w, group_sizes):
    """x (M, K), w (E, K, N) float32, group_sizes (E,) int -> (M, N): the module docstring's product, through
    the CPU kernels (call it where `supports` holds)."""
    (_, K), (E, K2, N) = x.shape, w.shape
    if K2 != K or group_sizes.shape != (E,):
        raise ValueError(f"grouped_matmul: expected x (M, K), w (E, K, N), group_sizes (E,); got x {x.shape}, "
                         f"w {w.shape}, group_sizes {group_sizes.shape}")
    pk, pn = -K % 16, -N % 16  # zeros: the products unchanged
    x = jnp.pad(x, ((0, 0), (0, pk)))
    w = jnp.pad(w, ((0, 0), (0, pk), (0, pn)))
    return _grouped(x, w, group_sizes.astype(jnp.int32))[:, :N]


def _call(target, out_shape, *args):
    return KERNELS.call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32), *args)


@jax.custom_vjp
def _grouped(x, w, sizes):
    return _call(PRODUCT, (x.shape[0], w.shape[2]), x, w, sizes)


def _forward(x, w, sizes):
    return _grouped(x, w, sizes), (x, w, sizes)


def _backward(saved, dy):
    x, w, sizes = saved
    dx = _call(PRODUCT, x.shape, dy, jnp.swapaxes(w, 1, 2), sizes)
    return dx, _call(WEIGHTS, w.shape, x, dy, sizes), None


_grouped.defvjp(_forward, _backward)

__all__ = ["KERNELS", "grouped_matmul", "grouped_matmul_reference", "supports"]
