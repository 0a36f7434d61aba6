"""What the wrappers of the Pallas kernels share around their pallas_call: default blocks per backend,
the GPU (Triton) kernels' fitted sizes and launch, the custom_vjp of kernels whose backward recomputes
from their prepared inputs, and the XLA work before the kernels. The kernels' own building blocks are
in kernels/pallas_blocks.py.

- `INTERPRET_BLOCKS`, `block_defaults`, `block_sizes_for`: default blocks per backend (interpret mode
  on CPU);
- `ChunkConfig`, `chunk_launch`, `triton_call`: a chunked GPU kernel's fitted blocks and launch
  settings (a kernel's own config adds its fields to ChunkConfig), and its pallas_call through Triton;
- `recompute_vjp`: the custom_vjp of kernels whose backward recomputes from the prepared inputs;
- `check_shapes`: the wrappers' refusal of inputs whose shapes do not agree;
- `document_rows`, `padded_state`: each token's document and that of the token before it; the
  initial state, padded and optionally transposed.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.pallas_blocks import BlockSizes, fit_block
from kernels.segments import document_index

f32 = jnp.float32


# Interpret mode (CPU): its cost is per step, so whole value widths.
INTERPRET_BLOCKS = BlockSizes(block_t=16, block_v=128)


def block_defaults(gpu: BlockSizes):
    """A kernel's default_block_sizes(backend=None): `gpu` on GPU, INTERPRET_BLOCKS elsewhere."""
    return functools.partial(block_sizes_for, {"gpu": gpu, "cpu": INTERPRET_BLOCKS})


def block_sizes_for(table: dict, backend: str | None = None):
    """A kernel's default blocks on `backend` (None: JAX's default) from its table, which has a "cpu"
    entry for every backend it does not name (interpret mode)."""
    return table.get(backend or jax.default_backend(), table["cpu"])


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The fitted blocks and launch settings of a chunked GPU kernel (`chunk_launch`); a kernel's
    config subclasses it with its own static fields."""

    block_t: int
    block_v: int
    num_warps: int
    num_stages: int
    interpret: bool
    dtype: str  # operand dtype of the dots (the inputs')
    exact: bool  # float32 inputs: full-precision dots (no TF32) on GPU


def chunk_launch(blocks: BlockSizes, T: int, K: int, V: int, dtype, interpret: bool | None):
    """A chunked GPU kernel's sizes: (ChunkConfig's fields, Tp, Kp, Vp). K and V are padded to powers of
    two >= 16 (Triton dots), the chunk fitted to T and T padded to it, the value block shrunk to Vp;
    interpret=None: interpret mode everywhere but on GPU."""
    Kp, Vp = max(16, pl.next_power_of_2(K)), max(16, pl.next_power_of_2(V))
    C, bv = fit_block(blocks.block_t, T), min(blocks.block_v, Vp)
    fields = dict(block_t=C, block_v=bv, num_warps=blocks.num_warps or (4 if Kp * bv <= 64 * 64 else 8),
                  num_stages=blocks.num_stages,
                  interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
                  dtype=jnp.dtype(dtype).name, exact=dtype == f32)
    return fields, -(-T // C) * C, Kp, Vp


def triton_call(kernel, cfg, grid, in_specs, out_specs, out_shape, name, *args):
    """pallas_call of `kernel` over `grid` on args, through Triton with cfg's num_warps and num_stages
    (interpret mode if cfg.interpret)."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=cfg.interpret, name=name,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*args)


def recompute_vjp(prepare, forward, backward):
    """f(cfg, *inputs) = forward(cfg, *prepare(cfg, *inputs)), differentiable in the inputs, for kernels
    whose backward recomputes what it needs from the prepared inputs (the XLA work before the kernels:
    cumulative gates, token rows), which are the only residuals. backward(cfg, prepared, cotangents)
    returns the inputs' cotangents."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def f(cfg, *inputs):
        return forward(cfg, *prepare(cfg, *inputs))

    def f_fwd(cfg, *inputs):
        prepared = prepare(cfg, *inputs)
        return forward(cfg, *prepared), prepared

    f.defvjp(f_fwd, backward)
    return f


def check_shapes(where: str, expected: str, ok: bool, **arrays):
    """Refuse inputs whose shapes do not agree (ok False): a ValueError naming `where`, what was
    `expected` and each array's shape (None for an absent one)."""
    if not ok:
        got = ", ".join(f"{k} {None if x is None else x.shape}" for k, x in arrays.items())
        raise ValueError(f"{where}: expected {expected}; got {got}")


def document_rows(segment_ids, B: int, T: int, Tp: int):
    """(doc, prev) (B, Tp) int32: each token's document index (segments.document_index; padding
    continues the last document) and that of the token before it (0 before token 0)."""
    doc = jnp.pad(document_index(segment_ids, B, T), ((0, 0), (0, Tp - T)), mode="edge")
    return doc, jnp.pad(doc[:, :-1], ((0, 0), (1, 0)))


def padded_state(initial_state, B: int, H: int, K: int, V: int, transpose: bool = False):
    """The initial state (B, H, K', V') float32 zero-padded to (B, H, K, V), or its transpose
    (B, H, V, K) with `transpose`; zeros for None."""
    shape = (B, H, V, K) if transpose else (B, H, K, V)
    if initial_state is None:
        return jnp.zeros(shape, f32)
    s = initial_state.astype(f32)
    s = jnp.swapaxes(s, 2, 3) if transpose else s
    return jnp.pad(s, [(0, n - m) for n, m in zip(shape, s.shape)])
