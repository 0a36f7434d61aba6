"""GPTQ (Frantar et al., 2023): quantization of one weight with second-order error correction, in the
layout of layers/quant.py (codes and scales that `Quantized` holds and `project` multiplies by).

A projection y = x W, W (In, Out), calibrated on inputs X (N, In): the objective is the output error
||X W - X Q||^2 = tr((W - Q)^T H (W - Q)) with H = X^T X. Rows of W (the input channels; GPTQ's
columns in PyTorch's (Out, In) layout) are quantized one at a time, in order, and each row's rounding
error is pushed onto the rows not yet quantized through the inverse Hessian:

    U = chol(H^-1) (upper; H damped by `damp` x mean(diag H) first)
    for i in 0 .. In-1:   q_i = round(w_i / s) s,   e_i = (w_i - q_i) / U_ii,   w_j -= U_ij e_i  (j > i)

which is the optimal update of the remaining rows for the error of row i (Optimal Brain Quantization),
with the inverse Hessian of the remaining rows read off U's rows. Scales are layers/quant.py's
symmetric absmax per output column (int8) or per group of `group_size` input rows (int4, int3 codes
in int4 storage); a group's scale is taken from its rows as they stand when the first is reached
(after the earlier groups' corrections), as the reference implementation does. `act_order`
quantizes rows by decreasing H_ii (the inputs with the most energy first); the groups stay the
contiguous ones of the layout, so their scales are taken from the weights before any correction
("static groups"). An input that never fires (H_ii = 0) gets H_ii = 1 and its row is zeroed, as in the
reference. A weight's exact zeros (a pruned weight's, infer/prune.py) stay zero: their code is 0 and
the whole of their value, corrections included, goes onto the rows not yet quantized, as SparseGPT's
joint pruning and quantization does with its mask, and a group's scale is taken from its kept weights;
so pruning then quantizing keeps the pruned pattern (a float weight is never exactly 0 otherwise). Not
here: the lazy batch updates (a speed device of the reference, same result).

`Recorded` stands in for a weight while a model runs on calibration data (infer/quantize.py puts it
in each projection read through `project`): it multiplies as the weight does and adds the statistics
of its inputs to a dictionary (X^T X, and per input channel the largest and the summed |x| that AWQ
and SmoothQuant read, layers/smooth.py), so one forward pass of the float model gives every
projection's H (all from the float model's activations, not layer after layer from the quantized ones
as the reference does).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from layers.held import HeldWeight
from layers.quant import INT_DTYPE, SCALE_DTYPE

QMAX = {"int8": 127, "int4": 7, "int3": 3}  # symmetric codes in [-QMAX, QMAX]; int3 is stored as int4


def hessian(x: Float[Array, "N In"]) -> Float[Array, "In In"]:
    """H = X^T X of calibration inputs, in float32 (its scale does not matter to GPTQ)."""
    x = x.astype(jnp.float32)
    return x.T @ x


def prepare(w: Float[Array, "In Out"], h: Float[Array, "In In"], damp: float
            ) -> tuple[Float[Array, "In Out"], Float[Array, "In In"]]:
    """(w, h) in float32 as GPTQ and SparseGPT start: an input that never fires (H_ii = 0) gets H_ii = 1
    and its row of w zeroed; then `damp` x mean(diag H) is added to the diagonal."""
    w, h = w.astype(jnp.float32), h.astype(jnp.float32)
    dead = jnp.diag(h) == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(h.shape[0])
    return jnp.where(dead[:, None], 0.0, w), h


def inverse_factor(h: Float[Array, "In In"]) -> Float[Array, "In In"]:
    """U, upper triangular, with H^-1 = U^T U: row i holds the inverse Hessian of rows i.. (scaled)."""
    return jnp.linalg.cholesky(jnp.linalg.inv(h)).T


def _scales(w: Float[Array, "G Out"], bits: str) -> Float[Array, " Out"]:
    """absmax / QMAX per column of a group of rows, rounded to the layout's scale dtype (as
    layers/quant.absmax_quantize: codes divide by the stored scale)."""
    storage = "int8" if bits == "int8" else "int4"
    return (jnp.max(jnp.abs(w), axis=0) / QMAX[bits]).astype(SCALE_DTYPE[storage]).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "act_order"))
def gptq_quantize(w: Float[Array, "In Out"], h: Float[Array, "In In"], bits: str = "int4", *,
                  group_size: int | None = 32, act_order: bool = False, damp: float = 0.01
                  ) -> tuple[Shaped[Array, "In Out"], Float[Array, "_G Out"]]:
    """(codes, scales) of w (In, Out) minimising the error on inputs with Hessian h = X^T X: codes in
    w's shape (int8, or int4 storage for int4 and int3), scales (In / group_size, Out) as
    layers/quant.absmax_quantize gives (group_size None: one group, a scale per column)."""
    if bits not in QMAX:
        raise ValueError(f"gptq_quantize: bits={bits!r}; expected one of {tuple(QMAX)}")
    In, Out = w.shape
    g = group_size or In
    if In % g:
        raise ValueError(f"gptq_quantize: group_size={group_size} does not divide the input width {In}")
    if h.shape != (In, In):
        raise ValueError(f"gptq_quantize: the Hessian is {h.shape}; expected ({In}, {In}) for a weight {w.shape}")
    kept = w != 0  # a pruned weight's zeros stay zero (module docstring)
    w, h = prepare(w, h, damp)
    group_of = jnp.arange(In) // g
    if act_order:
        perm = jnp.argsort(-jnp.diag(h), stable=True)
        static = jax.vmap(lambda rows: _scales(rows, bits))(w.reshape(In // g, g, Out))  # (In/g, Out)
    else:
        perm = jnp.arange(In)
    u = inverse_factor(h[perm][:, perm])  # in quantizing order
    qmax, kept = QMAX[bits], kept[perm]

    def row(i, carry):
        w, codes, scales = carry  # w in quantizing order; codes and scales in the layout's order
        r = perm[i]
        if act_order:
            s = static[group_of[r]]
        else:  # a new group: its scale from its kept weights as they stand now
            rows = jnp.where(jax.lax.dynamic_slice_in_dim(kept, i, g), jax.lax.dynamic_slice_in_dim(w, i, g), 0.0)
            s = jnp.where(r % g == 0, _scales(rows, bits), scales[group_of[r]])
        q = jnp.where(kept[i], jnp.clip(jnp.round(w[i] / jnp.where(s > 0, s, 1.0)), -qmax, qmax), 0.0)
        err = (w[i] - q * s) / u[i, i]
        w = w - jnp.where(jnp.arange(In)[:, None] > i, u[i][:, None] * err[None, :], 0.0)
        return w, codes.at[r].set(q), scales.at[group_of[r]].set(s)

    init = (w[perm], jnp.zeros((In, Out), jnp.float32), jnp.zeros((In // g, Out), jnp.float32))
    _, codes, scales = jax.lax.fori_loop(0, In, row, init)
    storage = "int8" if bits == "int8" else "int4"
    return codes.astype(INT_DTYPE[storage]), scales.astype(SCALE_DTYPE[storage])


_RECORDING: list[dict] = []  # the statistics of the `recording` blocks open, innermost last


@contextlib.contextmanager
def recording():
    """A dict that every Recorded weight multiplied inside the block adds its inputs' statistics to, by its key.
    Outside the weights' pytree (whose static part is only key and in_ndim), so one compiled program serves
    every calibration of a model."""
    _RECORDING.append({})
    try:
        yield _RECORDING[-1]
    finally:
        _RECORDING.pop()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base"], meta_fields=["key", "in_ndim"])
@dataclasses.dataclass(frozen=True, eq=False)
class Recorded(HeldWeight):
    """A weight (its logical shape: contraction axes, then output axes) that adds the statistics of each
    input X (M, In) it multiplies to the open `recording`'s [key], a dict of "xtx" (X^T X), "absmax" and
    "abssum" (max and sum of |x| per input channel) and "rows" (float64 NumPy, through jax.debug.callback, so
    under jit too; sums, so the callbacks' order does not matter)."""
    base: Shaped[Array, "..."]
    key: int  # where the sums go in the recording
    in_ndim: int = 1

    def _add(self, x2):
        x2 = np.asarray(x2, np.float64)
        got = _RECORDING[-1].setdefault(self.key, {"xtx": 0.0, "absmax": 0.0, "abssum": 0.0, "rows": 0})
        got["xtx"] = got["xtx"] + x2.T @ x2
        got["absmax"] = np.maximum(got["absmax"], np.abs(x2).max(0))
        got["abssum"] = got["abssum"] + np.abs(x2).sum(0)
        got["rows"] += x2.shape[0]

    def matmul(self, x: Shaped[Array, "M In"], **dot_kwargs) -> Shaped[Array, "M Out"]:
        jax.debug.callback(self._add, x)
        return jax.lax.dot(x, self.base.astype(x.dtype), **dot_kwargs)
