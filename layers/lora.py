"""Low-rank adapters (LoRA, Hu et al. 2022): a weight read as W + (alpha / r) A B, W frozen, A (In, r)
and B (r, Out) trained, over the flattened contraction and output axes of W.

`LowRank` stands in for the array inside an `nnx.Param`, as `Quantized` does (layers/quant.py; made
by train/lora.py): a layer reads it as before, `w[...].astype(dtype)`, and `project` (layers/linear.py)
and any other read (indexing, jnp functions, via `__jax_array__`) get the merged array, formed in the
step that reads it; decode from `train.lora.merge_lora`'s model, which forms it once. B starts at
zero, so a new adapter leaves the model's function exactly as it was.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from layers.held import HeldWeight


@dataclasses.dataclass(frozen=True)
class LowRank(HeldWeight):
    """The frozen `base` (its logical shape: contraction axes, then output axes) and the update
    `scale` * a @ b, a (In, r) and b (r, Out) with In and Out the products of the contraction and
    output axes; `in_ndim` counts the contraction axes. scale and in_ndim are static."""
    base: Shaped[Array, "..."]
    a: Float[Array, "In R"]
    b: Float[Array, "R Out"]
    scale: float
    in_ndim: int = 1

    def merged(self) -> jax.Array:
        """W + scale * a @ b, in the base's shape and dtype."""
        delta = (self.a.astype(jnp.float32) @ self.b.astype(jnp.float32)) * self.scale
        return (self.base.astype(jnp.float32) + delta.reshape(self.base.shape)).astype(self.base.dtype)

    def __jax_array__(self):
        return self.merged()

    def __getitem__(self, key):
        return self if key is Ellipsis else self.merged()[key]

    def astype(self, dtype) -> "LowRank":
        return dataclasses.replace(self, base=self.base.astype(dtype), a=self.a.astype(dtype), b=self.b.astype(dtype))

    @property
    def T(self) -> jax.Array:
        return self.merged().T

    def reshape(self, *shape) -> "LowRank | jax.Array":
        """The (In, Out) matrix view `project` asks for; any other shape is merged."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        In, Out = self.a.shape[0], self.b.shape[1]
        if tuple(shape) in ((In, Out), (In, -1)):
            return dataclasses.replace(self, base=self.base.reshape(In, Out), in_ndim=1)
        return self.merged().reshape(shape)

    def matmul(self, x: Shaped[Array, "M In"], **dot_kwargs) -> Shaped[Array, "M Out"]:
        """x (M, In) @ the merged (In, Out) view. Merging costs r / M of the product (small in training,
        M = batch x length); b = 0 gives the base's product bit for bit, which x W + (x a) b does not
        (XLA may merge the two products that share x into one of another blocking)."""
        if self.ndim != 2:
            raise ValueError(f"LowRank.matmul: needs the (In, Out) view, got shape {self.shape}")
        return jax.lax.dot(x, self.merged().astype(x.dtype), **dot_kwargs)


def _flatten(w: LowRank):
    keys = [jax.tree_util.GetAttrKey(k) for k in ("base", "a", "b")]
    return list(zip(keys, (w.base, w.a, w.b), strict=True)), (w.scale, w.in_ndim)


def _unflatten(static, children):
    # Rebuilt without __init__: jit and tree.map put tracers or shape structs in the fields.
    w = object.__new__(LowRank)
    for f, v in zip(dataclasses.fields(LowRank), (*children, *static), strict=True):
        object.__setattr__(w, f.name, v)
    return w


jax.tree_util.register_pytree_with_keys(LowRank, _flatten, _unflatten)


def low_rank(base: jax.Array, rank: int, alpha: float, key: jax.Array, *, in_ndim: int = 1) -> LowRank:
    """A new adapter on `base`: a ~ N(0, 1 / In) (the scale of a fresh projection's input side), b = 0."""
    In = math.prod(base.shape[:in_ndim])
    Out = math.prod(base.shape[in_ndim:])
    a = jax.random.normal(key, (In, rank), jnp.float32) * In ** -0.5
    return LowRank(base=base, a=a.astype(base.dtype), b=jnp.zeros((rank, Out), base.dtype), scale=alpha / rank,
                   in_ndim=in_ndim)
