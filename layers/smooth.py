"""Per-input-channel scales of a projection, the rewrite under AWQ (Lin et al., 2024) and SmoothQuant
(Xiao et al., 2023): x W = (x / s) (diag(s) W) for any positive s (In,), so the weight can be quantized
as diag(s) W while the input is divided by s.

- AWQ (weight-only): s = m^alpha with m the mean |x| of each input channel on calibration data (as in
  the paper, normalised by sqrt(max m min m)), alpha searched on a grid of `grid` points in [0, 1] for the
  least output error ||X W - (X / s) Q(diag(s) W)||^2 = tr(E^T H E), E = W - diag(1/s) Q(diag(s) W),
  H = X^T X; alpha = 0 is s = 1, plain round-to-nearest, so the search never does worse than it.
- SmoothQuant (int8 weights and int8 activations): s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) with
  alpha = 0.5, moving the activations' outlier channels into the weights, whose per-column int8 scales
  bear them better than per-token activation scales do.

Departures, both documented in docs/decoding.md: every s is rounded to a power of two, so the rewrite
is exact in float (dividing and multiplying by 2^k loses nothing: the smoothed float model computes the
original's numbers bit for bit); and the division by s stays with each projection (`Scaled` multiplies
its input by 1/s) instead of being folded into the norm before it, one elementwise product per
projection, and one search per projection where AWQ shares one between the projections reading one norm.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from layers.held import HeldMatrix
from layers.quant import Quantized, absmax_quantize, dequantize_codes


def power_of_two(s: Float[Array, " In"]) -> Float[Array, " In"]:
    """s rounded to the nearest power of two (in log scale); 1 where s is 0 or not finite (a dead input)."""
    ok = jnp.isfinite(s) & (s > 0)
    return jnp.where(ok, jnp.exp2(jnp.round(jnp.log2(jnp.where(ok, s, 1.0)))), 1.0).astype(jnp.float32)


def rtn_error(w: Float[Array, "In Out"], h: Float[Array, "In In"], s: Float[Array, " In"], bits: str,
              group_size: int | None) -> Float[Array, ""]:
    """tr(E^T H E), E = w - diag(1/s) Q(diag(s) w), Q round-to-nearest (layers/quant.absmax_quantize)."""
    codes, scale = absmax_quantize(w * s[:, None], bits, group_size)
    e = w - dequantize_codes(codes, scale) / s[:, None]
    return jnp.sum(e * (h @ e))


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "grid"))
def awq_scales(w: Float[Array, "In Out"], h: Float[Array, "In In"], mean_abs: Float[Array, " In"], bits: str,
               group_size: int | None, grid: int = 20) -> Float[Array, " In"]:
    """AWQ's s for w (In, Out) from its inputs' Hessian h and per-channel mean |x|: the power-of-two
    m^alpha (normalised) of least `rtn_error` over alpha in {0, 1/grid, ..., (grid-1)/grid}."""
    w, h = w.astype(jnp.float32), h.astype(jnp.float32)
    m = jnp.where(mean_abs > 0, mean_abs, jnp.max(mean_abs)).astype(jnp.float32)
    m = m / jnp.sqrt(jnp.max(m) * jnp.min(m))
    candidates = jnp.stack([power_of_two(m ** (i / grid)) for i in range(grid)])  # (grid, In)
    errors = jax.vmap(lambda s: rtn_error(w, h, s, bits, group_size))(candidates)
    return candidates[jnp.argmin(errors)]  # ties: the smaller alpha, so alpha = 0 unless another is better


def smoothquant_scales(w: Float[Array, "In Out"], absmax_x: Float[Array, " In"], alpha: float = 0.5
                       ) -> Float[Array, " In"]:
    """SmoothQuant's s = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j, as a power of two."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothquant_scales: alpha={alpha!r}; expected a number in [0, 1]")
    wmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1)
    return power_of_two(absmax_x.astype(jnp.float32) ** alpha / wmax ** (1 - alpha))


@dataclasses.dataclass(frozen=True, eq=False)
class Scaled(HeldMatrix):
    """A weight of logical `shape` (`in_ndim` contraction axes, then output axes) held as base =
    diag(s) W (In, Out), a float array or a `Quantized`, and inv_scale = 1 / s (In,): `project`
    multiplies x / s by base; any other read gets diag(1/s) base, the weight itself."""
    base: Shaped[Array, "In Out"] | Quantized
    inv_scale: Float[Array, " In"]
    shape: tuple[int, ...]
    in_ndim: int = 1

    @property
    def dtype(self):
        return self.base.dtype

    def matrix(self) -> jax.Array:
        dense = self.base.dequantize() if isinstance(self.base, Quantized) else self.base
        return dense * self.inv_scale[:, None].astype(dense.dtype)

    def astype(self, dtype) -> "Scaled":
        return dataclasses.replace(self, base=self.base.astype(dtype))

    def matmul(self, x: Shaped[Array, "M In"], **dot_kwargs) -> Shaped[Array, "M Out"]:
        x = x * self.inv_scale.astype(x.dtype)
        if isinstance(self.base, Quantized):
            return self.base.matmul(x, **dot_kwargs)
        return jax.lax.dot(x, self.base.astype(x.dtype), **dot_kwargs)


def _flatten(s: Scaled):
    return [(jax.tree_util.GetAttrKey("base"), s.base), (jax.tree_util.GetAttrKey("inv_scale"), s.inv_scale)], \
        (s.shape, s.in_ndim)


def _unflatten(static, children):
    # Rebuilt without __init__ (as layers/quant.Quantized): jit and tree.map put tracers or shape structs in it.
    s = object.__new__(Scaled)
    for name, v in zip(("base", "inv_scale", "shape", "in_ndim"), (*children, *static)):
        object.__setattr__(s, name, v)
    return s


jax.tree_util.register_pytree_with_keys(Scaled, _flatten, _unflatten)


def scaled(w: Float[Array, "..."], s: Float[Array, " In"], in_ndim: int = 1, quantize=None) -> Scaled:
    """w (logical shape, `in_ndim` contraction axes) held as diag(s) w and 1/s; `quantize` (a function of
    the (In, Out) matrix, e.g. to a `Quantized`) applied to diag(s) w."""
    In = math.prod(w.shape[:in_ndim])
    base = w.reshape(In, -1) * s[:, None].astype(w.dtype)
    return Scaled(base if quantize is None else quantize(base), (1 / s).astype(jnp.float32), tuple(w.shape), in_ndim)
