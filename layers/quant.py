"""Quantized weights and KV-cache entries: symmetric absmax round-to-nearest, the value type that
holds a weight as integers and scales, and its matrix product.

    int8, per output channel:   s_n = max_k |W_kn| / 127,      Q_kn = round(W_kn / s_n) in [-127, 127]
    int4, groups of g rows:     s_jn = max_{k in j} |W_kn| / 7, Q_kn = round(W_kn / s_jn) in [-7, 7]
    KV cache, per token & head: s = max_k |k_k| / 127,          k ≈ Q s

W ≈ Q s with |W - Q s| <= s / 2 everywhere. The int8 layout is LLM.int8()'s vector-wise weight scale
(Dettmers et al., 2022) without its outlier decomposition; the int4 layout is the grouped one of GPTQ
and AWQ (Frantar et al., 2023; Lin et al., 2024), here rounded to nearest, without GPTQ's error
correction or AWQ's activation-aware scales. Codes stay in [-127, 127] and [-7, 7] (the symmetric
range; -128 / -8 go unused). int4 codes are `jnp.int4`, which XLA on CPU stores two to a byte
(a resident-memory measurement in benchmarks/quantize.py; `.nbytes` still counts one byte each).

`Quantized` stands in for the array inside an `nnx.Param` (infer/quantize.py puts it there). A layer
reads it as before, `w[...].astype(dtype)`, and `project` (layers/linear.py) multiplies by it:
- dot="int8": each row of the input is quantized on the fly (per-token absmax, as LLM.int8()'s
  vector-wise activations) and int8 x int8 -> int32 is one `dot_general`; the two scales multiply the
  int32 result. On CPU, XLA hands this dot to YNNPACK, which reads the int8 weights as they are: the
  only form found here that decodes faster than float32 (benchmarks/quantize_forms.py, 2 shared
  cores: 1.2-2.0x float32's speed at batch 1, 1.8x at batch 8; the float forms 0.7x). int4 weights are
  first requantized to int8 per output column (its int8 step is 7/127, about 1/18, of the int4 step
  of the column's widest group: little added error). In a decode loop that is loop-invariant and XLA
  does it once per call, so int4 decodes at int8's speed with an int8 copy beside its codes.
- dot="float": the weight is dequantized and multiplied in float (exact activations). In a decode
  loop XLA hoists this loop-invariant dequantization out of the loop (while-loop invariant code
  motion): decoding runs on a float copy made once per call, at float speed and float memory; the
  quantized size holds only at rest.
A parameter read any other way (indexing, jnp functions: `lazy=False`, or via `__jax_array__`) gets
the dequantized array.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int8, Shaped

from layers.held import HeldWeight

INT_MAX = {"int8": 127, "int4": 7}
INT_DTYPE = {"int8": jnp.int8, "int4": jnp.int4}
SCALE_DTYPE = {"int8": jnp.float32, "int4": jnp.bfloat16}


@functools.partial(jax.jit, static_argnums=(1, 2))
def absmax_quantize(w: Float[Array, "*lead In Out"], bits: str, group_size: int | None = None
                    ) -> tuple[Shaped[Array, "*lead In Out"], Float[Array, "*lead _G Out"]]:
    """Codes (int8 or int4, w's shape) and scales (*lead, In / group_size, Out) of w, per output column
    over groups of `group_size` input rows (None: all In rows, one scale per column). int4 scales are
    bfloat16 (GGML's Q4_0 keeps float16 ones): 0.5625 bytes a weight at groups of 32, not 0.625. The
    codes divide by the stored, rounded scale, so |w - codes * scale| <= scale / 2 holds for it (bfloat16
    rounds by at most 2^-8 of a value, so no code passes 7.03 before rounding and none is clipped)."""
    *lead, In, Out = w.shape
    g = group_size or In
    wg = w.astype(jnp.float32).reshape(*lead, In // g, g, Out)
    s = (jnp.max(jnp.abs(wg), axis=-2) / INT_MAX[bits]).astype(SCALE_DTYPE[bits])  # (*lead, In/g, Out)
    s32 = s.astype(jnp.float32)
    q = jnp.clip(jnp.round(wg / jnp.where(s32 > 0, s32, 1)[..., None, :]), -INT_MAX[bits], INT_MAX[bits])
    return q.reshape(w.shape).astype(INT_DTYPE[bits]), s  # an all-zero group: codes 0, scale 0


def dequantize_codes(values: Shaped[Array, "*lead In Out"], scale: Float[Array, "*lead _G Out"], dtype=jnp.float32
                     ) -> Shaped[Array, "*lead In Out"]:
    *lead, In, Out = values.shape
    G = scale.shape[-2]
    v = values.reshape(*lead, G, In // G, Out).astype(jnp.float32)
    return (v * scale[..., None, :].astype(jnp.float32)).reshape(values.shape).astype(dtype)


def quantize_rows(x: Float[Array, "*B K"]) -> tuple[Int8[Array, "*B K"], Float[Array, "*B 1"]]:
    """int8 codes of each row of x (its last axis) and the row's float32 scale max|x| / 127."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    return jnp.round(x / jnp.where(s > 0, s, 1)).astype(jnp.int8), s


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight of logical `shape` (stacked lead axes, contraction axes, output axes) held as codes
    `values` (*lead, In, Out) and scales `scale` (*lead, In / group_size, Out), In and Out the products
    of the contraction and of the output axes. `transposed` marks the (Out, In) view of a tied
    embedding table (its rows are the LM head's output columns). All but values and scale is static
    (part of the jit cache key)."""
    values: Shaped[Array, "*lead In Out"]  # int8 or int4 codes
    scale: Float[Array, "*lead _G Out"]  # one per output column and group of input rows (int4: bfloat16)
    shape: tuple[int, ...]
    lead: int = 0  # leading stacked axes (exit heads, experts): indexing one gives a Quantized
    transposed: bool = False
    dtype: object = jnp.float32  # the dtype it is read as (`astype`)
    lazy: bool = True  # `w[...]` returns the Quantized itself (for `project`), else the float array
    dot: str = "float"  # "int8": W8A8 with per-token int8 activations; "float": dequantize, then multiply

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def bits(self) -> str:
        return "int4" if self.values.dtype == jnp.int4 else "int8"

    @property
    def nbytes(self) -> int:
        """Bytes held: codes (int4 at half a byte, as XLA on CPU stores them) and scales."""
        per = 0.5 if self.bits == "int4" else 1
        return int(self.values.size * per) + self.scale.nbytes

    def dequantize(self) -> jax.Array:
        w = dequantize_codes(self.values, self.scale, self.dtype)  # (*lead, In, Out)
        return w.T if self.transposed else w.reshape(self.shape)

    def __jax_array__(self):
        return self.dequantize()

    def astype(self, dtype) -> "Quantized":
        return dataclasses.replace(self, dtype=dtype)

    @property
    def T(self) -> "Quantized | jax.Array":
        if self.ndim != 2 or self.lead:
            return self.dequantize().T
        return dataclasses.replace(self, shape=self.shape[::-1], transposed=not self.transposed)

    def reshape(self, *shape) -> "Quantized | jax.Array":
        """The (In, Out) matrix view `project` asks for, as metadata; any other shape is dequantized."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        In, Out = self.values.shape[-2:]
        if not self.lead and not self.transposed and tuple(shape) in ((In, Out), (In, -1)):
            return dataclasses.replace(self, shape=(In, Out))
        return self.dequantize().reshape(shape)

    def __getitem__(self, key):
        if key is Ellipsis:
            return self if self.lazy else self.dequantize()
        if self.lead and isinstance(key, int):  # one of the stacked weights (an exit head)
            return dataclasses.replace(self, values=self.values[key], scale=self.scale[key], shape=self.shape[1:],
                                       lead=self.lead - 1)
        return self.dequantize()[key]

    def as_int8(self) -> tuple[Int8[Array, "In Out"], Float[Array, "1 Out"]]:
        """int4 codes and group scales requantized to int8 per output column. A column's largest |w| is
        7 times its largest group scale (each nonzero group has a code of +-7), so the int8 scale comes
        from the scales alone and the codes in one elementwise pass: no reduction over the weight."""
        s8 = jnp.max(self.scale.astype(jnp.float32), axis=0, keepdims=True) * (7 / 127)  # (1, Out)
        w = dequantize_codes(self.values, self.scale)  # (In, Out), fused into the rounding below
        return jnp.round(w / jnp.where(s8 > 0, s8, 1)).astype(jnp.int8), s8

    def matmul(self, x: Shaped[Array, "M In"], preferred_element_type=None) -> Shaped[Array, "M Out"]:
        """x (M, In) @ the (In, Out) weight."""
        if self.lead or self.transposed or self.ndim != 2:
            raise ValueError(f"Quantized.matmul: needs the (In, Out) view, got logical shape {self.shape}")
        out = preferred_element_type or jnp.result_type(x.dtype, self.dtype)
        if self.dot != "int8":
            return jax.lax.dot(x.astype(self.dtype), self.dequantize(), preferred_element_type=out)
        codes, scale = (self.values, self.scale) if self.bits == "int8" else self.as_int8()
        xq, sx = quantize_rows(x)  # (M, In) int8, (M, 1)
        M = x.shape[0]
        if M == 1 and jax.default_backend() == "cpu":
            # XLA on CPU sends a dot of one row to its own matrix-vector loop, which widens the int8
            # weights to int32 (4 bytes again, 1.4x slower than float); from two rows on it calls
            # YNNPACK's int8 kernel. A copy of the row costs nothing beside the weight read.
            xq = jnp.concatenate([xq, xq])
        acc = jax.lax.dot_general(xq, codes, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return (acc[:M].astype(jnp.float32) * (sx * scale[0])).astype(out)  # (M, Out)


def _flatten(q: Quantized):
    static = tuple(getattr(q, f.name) for f in dataclasses.fields(q)[2:])
    return [(jax.tree_util.GetAttrKey("values"), q.values), (jax.tree_util.GetAttrKey("scale"), q.scale)], static


def _unflatten(static, children):
    # Rebuilt without __init__: jit and tree.map put tracers or shape structs in the fields (layers/state.py).
    q = object.__new__(Quantized)
    for f, v in zip(dataclasses.fields(Quantized), (*children, *static)):
        object.__setattr__(q, f.name, v)
    return q


jax.tree_util.register_pytree_with_keys(Quantized, _flatten, _unflatten)


def quantize_weight(w: Float[Array, "..."], bits: str, *, in_ndim: int = 1, lead: int = 0,
                    group_size: int | None = None, transposed: bool = False, lazy: bool = True,
                    dot: str = "float") -> Quantized:
    """A `Quantized` of w, scaled per output column (over groups of `group_size` input rows for int4).
    `transposed`: w is (Out, In), a tied embedding table whose rows are the output columns."""
    m = w.T if transposed else w
    lead_shape = m.shape[:lead]
    In = math.prod(m.shape[lead:lead + in_ndim])
    values, scale = absmax_quantize(m.reshape(*lead_shape, In, -1), bits, group_size)
    return Quantized(values=values, scale=scale, shape=tuple(w.shape), lead=lead, transposed=transposed,
                     dtype=w.dtype, lazy=lazy, dot=dot)


@jax.custom_vjp
def straight_through(x: jax.Array, rounded: jax.Array) -> jax.Array:
    """`rounded` itself, with x's gradient: the straight-through estimator (Bengio et al., 2013) that
    quantization-aware training differentiates rounding with."""
    return rounded


straight_through.defvjp(lambda x, rounded: (rounded, None), lambda _, g: (g, None))


@dataclasses.dataclass(frozen=True)
class Int8Rows(HeldWeight):
    """Quantization-aware training's face of a weight that decodes as W8A8 (`quantized`, dot="int8";
    infer/quantize.fake_quantize makes it): its product is `quantized.matmul`'s, number for number, and
    its gradient is that of rows rounded to int8 per token times `base`, the weight as the quantized
    product reads it, straight through to the float weight."""
    base: Shaped[Array, "..."]
    quantized: Quantized
    in_ndim: int = 1

    def __jax_array__(self):
        return self.base

    @property
    def T(self) -> "Int8Rows":
        """A tied embedding table (V, D) read as the LM head (D, V), as infer.quantize holds it."""
        return dataclasses.replace(self, base=self.base.T, quantized=self.quantized.T)

    def reshape(self, *shape) -> "Int8Rows | jax.Array":
        matrix = super().reshape(*shape)
        if isinstance(matrix, Int8Rows):
            return dataclasses.replace(matrix, quantized=self.quantized.reshape(matrix.base.shape))
        return matrix

    def matmul(self, x: Shaped[Array, "M In"], preferred_element_type=None) -> Shaped[Array, "M Out"]:
        return _w8a8(x, self.base.astype(x.dtype), self.quantized, preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _w8a8(x, w, quantized, preferred_element_type):
    return quantized.matmul(x, preferred_element_type)


def _w8a8_forward(x, w, quantized, preferred_element_type):
    return quantized.matmul(x, preferred_element_type), (x, w)


def _w8a8_backward(preferred_element_type, saved, g):
    x, w = saved
    codes, scale = quantize_rows(x)
    rounded = (codes.astype(jnp.float32) * scale).astype(x.dtype)
    return (g @ w.T).astype(x.dtype), (rounded.T @ g).astype(w.dtype), None


_w8a8.defvjp(_w8a8_forward, _w8a8_backward)
jax.tree_util.register_dataclass(Int8Rows, data_fields=["base", "quantized"], meta_fields=["in_ndim"])
