"""Building blocks the chunked Pallas kernels share: GLA (and the ops built on it), the delta rule and
WKV-7, in their GPU (Triton) and TPU (Mosaic) forms. One home, so that a fix reaches every kernel.

- `BlockSizes`, `check_blocks`, `supports`, `fit_block`: the GPU kernels' block knobs, their check,
  and the auto-dispatch rule;
- `dot`, `EXACT`: a 2-D dot in the inputs' dtype (float32 result), or in full float32 for bookkeeping;
- `row_of`, `col_of`, `row`, `column`: rows and columns of tiles by a mask and a reduction (the index
  may be a loop counter), with no transposes or dynamic slices on chip;
- `unit_lower_inverse_t`: ((I + A)^{-1})^T of a strictly lower-triangular tile, by forward substitution;
- `local_cumsum`, `doc_suffix_sum`: the XLA work around the kernels (chunk-local cumulative gates,
  the gate gradient's suffix sum within each document).

What the wrappers around the kernels share (fitting, launch, custom_vjp, inputs) is in
kernels/pallas_launch.py. Loop counters, iotas and 0/1 tiles come from kernels/x64.py (int32 and
float32 under x64).
"""

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.x64 import fori_loop, indicator, iota

f32 = jnp.float32

EXACT = SimpleNamespace(dtype="float32", exact=True)  # `dot` settings of float32 bookkeeping (masks, inverses)


def check_blocks(blocks, names, least: int):
    """Refuse a block size among `names` of the dataclass `blocks` that is not a power of two >= least."""
    for name in names:
        b = getattr(blocks, name)
        if b < least or b & (b - 1):
            raise ValueError(f"BlockSizes.{name}={b} must be a power of two" + (f" >= {least}" if least > 1 else ""))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tokens per chunk (block_t) and value columns per program (block_v), powers of two >= 16, and
    GPU launch knobs. Blocks larger than the padded sequence or value width are shrunk to it."""

    block_t: int = 16
    block_v: int = 64
    num_warps: int | None = None  # None: 4 when K * block_v <= 64 * 64, else 8
    num_stages: int = 2

    def __post_init__(self):
        check_blocks(self, ("block_t", "block_v"), 16)


def supports(q, k, v) -> bool:
    """Whether impl="auto" runs the kernel on GPU: float dtypes, head dims <= 256, and more than 16
    tokens (a decode step is a few K x V updates, cheaper in XLA than a launch per head). A
    heuristic, not measured."""
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    return (all(x.dtype in dtypes for x in (q, k, v)) and max(q.shape[-1], v.shape[-1]) <= 256
            and q.shape[1] > 16)


def fit_block(block, n, least: int = 16):
    """The block shrunk to n (rounded up to a power of two), at least `least`."""
    return min(block, max(least, pl.next_power_of_2(n)))


def dot(a, b, dims, cfg):
    """a @ b contracting a's axis dims[0] with b's axis dims[1] (2-D), float32 result. The operands
    are cast to cfg.dtype (None: taken as they are); cfg.exact asks for full-precision dots (no TF32)
    on GPU."""
    precision = lax.Precision.HIGHEST if cfg.exact else lax.Precision.DEFAULT
    if cfg.dtype is not None:
        a, b = a.astype(cfg.dtype), b.astype(cfg.dtype)
    return lax.dot_general(a, b, (((dims[0],), (dims[1],)), ((), ())), precision=precision,
                           preferred_element_type=f32)


def row_of(x, j):
    """Row j of a (C, X) tile, as (1, X) (a mask and a sublane reduction: j may be traced)."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == j, x, 0.0), axis=0, keepdims=True)


def col_of(x, j):
    """Column j of a (X, C) tile, as (X, 1)."""
    return jnp.sum(jnp.where(iota((1, x.shape[1]), 1) == j, x, 0.0), axis=1, keepdims=True)


def column(x):
    """(1, K) -> (K, 1), by a diagonal mask and a lane reduction (no transpose)."""
    K = x.shape[1]
    return jnp.sum(jnp.where(iota((K, K), 0) == iota((K, K), 1), x, 0.0), axis=1, keepdims=True)


def row(x):
    """(K, 1) -> (1, K), by a diagonal mask and a sublane reduction."""
    K = x.shape[0]
    return jnp.sum(jnp.where(iota((K, K), 0) == iota((K, K), 1), x, 0.0), axis=0, keepdims=True)


def unit_lower_inverse_t(A):
    """N = ((I + A)^{-1})^T for a strictly lower-triangular (C, C) tile A. Row i of M = (I + A)^{-1}
    is e_i - sum_{j < i} A_ij M_j: forward substitution, written into column i of N."""
    C = A.shape[0]

    def step(i, N):
        a = jnp.sum(jnp.where(iota((C, C), 0) == i, A, 0.0), axis=0, keepdims=True)  # (1, C): A_i
        m = indicator(iota((C, 1), 0) == i) - jnp.sum(N * a, axis=1, keepdims=True)  # (C, 1)
        return jnp.where(iota((C, C), 1) == i, m, N)

    return fori_loop(0, C, step, jnp.zeros((C, C), f32))


def local_cumsum(g, chunk: int, axis: int = 1):
    """g summed from each chunk's start along its time axis `axis` (a multiple of `chunk` long), float32."""
    axis %= g.ndim
    chunks = g.shape[:axis] + (g.shape[axis] // chunk, chunk) + g.shape[axis + 1:]
    return jnp.cumsum(g.astype(f32).reshape(chunks), axis=axis + 1).reshape(g.shape)


def doc_suffix_sum(x, doc, prev):
    """y_t = sum of x_s over s >= t in t's document, and 0 at a document start. x (B, T, ...);
    doc (B, T) the document index of each token, prev (B, T) that of the token before."""
    d = doc.reshape(doc.shape + (1,) * (x.ndim - 2)).astype(f32)
    same_next = jnp.concatenate([d[:, 1:] == d[:, :-1], jnp.zeros_like(d[:, :1], bool)], axis=1)
    combine = lambda a, b: (a[0] * b[0], b[1] + b[0] * a[1])  # a: the later tokens, b: this one
    _, y = lax.associative_scan(combine, (jnp.broadcast_to(same_next, x.shape).astype(f32), x),
                                reverse=True, axis=1)
    start = (doc != prev).reshape(d.shape)
    return jnp.where(start, 0.0, y)
