"""Flash attention for TPU in Pallas (Mosaic TPU): FlashAttention-2 (Dao, 2023, arXiv:2307.08691).

The same function as `flash_attention` in pallas.py (the GPU kernel, whose docstring has the
equations) and as attention_reference, with the same arguments. Forward, query block i against key
blocks j, logits s = scale q k^T:

    m_i^(j) = max(m_i^(j-1), rowmax(s_ij)),   l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(P~_ij)
    O_i^(j) = exp(m_i^(j-1) - m_i^(j)) O_i^(j-1) + P~_ij V_j,   P~_ij = exp(s_ij - m_i^(j))
    O_i = O_i^(last) / l_i^(last),   L_i = m_i + log l_i        (logsumexp, saved for the backward)

Backward, P_ij = exp(s_ij - L_i) recomputed: D_i = rowsum(dO_i * O_i) (in XLA),
dS_ij = P_ij * (dO_i V_j^T - D_i), dQ_i = scale sum_j dS_ij K_j, dK_j = scale sum_i dS_ij^T Q_i,
dV_j = sum_i P_ij^T dO_i. Code names: `m`, `l`, `acc` (unnormalised O), `lse` (L), `delta` (D),
`p` (P), `ds` (dS), `qa` (each query's document start). Masks are the reference's: key j is visible
from query i iff kp_j <= qp_i (causal), the segment ids agree and j is in query head h's band (window,
sinks, dilation, growth: masks.Band as pallas.KernelBand, static, shared or per head); a query that sees no key returns
zeros (and has L = 0). A decay (reference.py; FoX's cumulative log forget gate) adds qd_i - kd_j to
s_ij per query head, and the dK/dV kernel returns d kd_j = -sum_i dS_ij per query head (d qd = 0: a
per-query shift cancels in the softmax), as in pallas.py.

TPU design (one Pallas call per kernel, the reduction axis last and "arbitrary"):
- forward: grid (B, H, T/bq, S/bk). Each step brings one (bq, K) query block and one (bk, K) key and
  value block into VMEM; m, l (bq, 1) and acc (bq, V) float32 live in VMEM scratch across the key
  steps, set at the first and written out (O and L) at the last.
- dQ: the same grid; dQ (bq, K) float32 accumulates in scratch over the key blocks.
- dK/dV: grid (B, G, S/bk, R, T/bq) with the R = H / G query heads of a kv head and the query
  blocks both "arbitrary": dK, dV (bk, K|V) float32 accumulate in scratch over both, so each kv
  head's gradient is summed over its query heads in one program, deterministically (no atomics).
- Grouped-query attention: query head h reads kv head h // R through the index maps; K/V are never
  repeated. Heads are addressed in place: q is viewed as (B, T, H * K) and a block is (bq, K) at
  column block h, so no (B, H, T, K) transpose is made.
- Stored for the backward: q, k, v, o and L as (B, H, T, 1) float32 (4 bytes per query and head).
- Per-token ints: query positions and segment ids as (B, T, 1) arrays in (bq, 1) blocks, key ones as
  (B, 1, S) arrays in (1, bk) blocks (lane-dense; bk a multiple of 128 or the whole padded S). The
  decay per query head likewise: qd (B, H, T, 1) like L, kd and d kd (B, H, 1, S) in (1, bk) blocks;
  d kd (1, bk) float32 accumulates in scratch over the query blocks of one query head r.

Block skipping: when q_positions and kv_positions are both None (positions are the index, queries
the last T of the S keys), the causal and window bounds give, from the program ids alone, the range
of key blocks a query block can see (and of query blocks a key block is seen by). Steps outside it
do no work (pl.when), and the index maps clamp the block index into the range, so the pipeline does
not fetch a new block for them. With sinks, the blocks before that range (key blocks; for dK/dV the
later query blocks) are fetched too and a step there runs only when its mask lets a key through.
With explicit positions every block is visited and masked.

Backend: Mosaic TPU, the only Pallas backend for TPU. `interpret=None` runs the TPU interpreter
(pltpu.InterpretParams) everywhere but on a TPU; `jax.jit(f).trace(...).lower(lowering_platforms=
("tpu",))` checks the Mosaic lowering without a TPU (tests/kernels/test_attention_pallas_tpu.py).

Departures from the GPU kernel (pallas.py) and the paper:
- natural exp/log instead of the GPU kernel's base 2 (the same function; L is in nats here);
- the TPU grid above instead of one program per query block looping over all of K/V in the ref;
- head dims are padded to a multiple of 128 on a TPU (Mosaic's lane tiling; zero channels change no
  dot product and are sliced off), not padded in interpret mode; T and S are padded to the blocks:
  padded keys are masked, padded queries have zero cotangents and are sliced off.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels.attention.masks import Band, Tokens
from kernels.attention.pallas import MASK, KernelBand, decay_rows, fit_blocks, flash_vjp, mask_rows
from kernels.pallas_blocks import dot
from kernels.x64 import div, iota


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per block (powers of two >= 8) for the forward, dK/dV and dQ kernels.

    Blocks larger than the sequence are shrunk to it (to a power of two, at least 8). On a TPU the
    key blocks must be multiples of 128 (they are the lane dim of the key rows) unless they cover
    the whole padded S. Defaults for v5e/v6e: 512 x 512 forward tiles (the (bq, bk) float32 logits
    are 1 MiB, far inside the scoped VMEM) and 256 x 256 backward tiles, which hold more live tiles
    (P, dP, dS); not yet tuned on a device.
    """

    block_q: int = 512
    block_k: int = 512
    block_q_dkv: int = 256
    block_k_dkv: int = 256
    block_q_dq: int = 256
    block_k_dq: int = 256

    def __post_init__(self):
        for f in dataclasses.fields(self):
            b = getattr(self, f.name)
            if b < 8 or b & (b - 1):
                raise ValueError(f"BlockSizes.{f.name}={b} must be a power of two >= 8")


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    causal: bool
    band: KernelBand | None
    segmented: bool
    decay: bool  # qd, kd are inputs (and d kd an output of the dK/dV kernel)
    kv_len: int  # S before padding: keys at index >= kv_len are padding
    kv_padded: bool
    q_offset: int | None  # both positions None: query t sits at t + q_offset, key j at j; else None
    heads: tuple[int, int]  # (H, G)
    blocks: tuple[int, ...]  # (bq, bk, bq_dkv, bk_dkv, bq_dq, bk_dq) after fitting
    padded: tuple[int, int]  # (T, S) padded to the blocks
    interpret: bool
    exact: bool  # float32 inputs: full-precision dots
    dtype: None = None  # pallas_blocks.dot takes the operands as they are


def _dot(a, b, cfg, trans_b=False):
    """a (m, k) @ b (k, n), or @ b^T for b (n, k); float32 accumulation."""
    return dot(a, b, (1, 1 if trans_b else 0), cfg)


def _span(cfg):
    """The band's widest span when key blocks before it can be skipped (positions are the indices)."""
    return None if cfg.q_offset is None or cfg.band is None else cfg.band.max_span


def _sinks(cfg):
    """Whether blocks outside the window's range may hold sinks (and are masked to find out)."""
    return _span(cfg) is not None and cfg.band.sinks is not None


def _kv_range(i, bq, bk, nk, cfg):
    """Key blocks [lo, hi] that can hold a key visible from query block i (a superset), and the
    blocks [0, hi] to fetch when the blocks before lo may hold sinks (None: no sinks)."""
    lo, hi = 0, nk - 1
    if cfg.q_offset is not None and cfg.causal:  # the block's last query sits at (i+1) bq - 1 + off
        hi = jnp.minimum(div(jnp.maximum((i + 1) * bq - 1 + cfg.q_offset, 0), bk), nk - 1)
    if _span(cfg) is not None:  # its first sees keys > i bq + off - span
        lo = jnp.minimum(div(jnp.maximum(i * bq + cfg.q_offset - _span(cfg) + 1, 0), bk), nk - 1)
    return (lo, hi), (0, hi) if _sinks(cfg) else None


def _q_range(j, bq, bk, nq, cfg):
    """Query blocks [lo, hi] that can see a key of key block j (a superset), and the blocks [lo,
    nq - 1] to fetch when the later blocks may see one as a sink (None: no sinks)."""
    lo, hi = 0, nq - 1
    if cfg.q_offset is not None and cfg.causal:  # query t sees key j bk only if t + off >= j bk
        lo = jnp.minimum(div(jnp.maximum(j * bk - cfg.q_offset, 0), bq), nq - 1)
    if _span(cfg) is not None:  # the block's first query i bq + off
        hi = jnp.minimum(div(jnp.maximum((j + 1) * bk - 2 - cfg.q_offset + _span(cfg), 0), bq),
                         nq - 1)  # sees key (j+1) bk - 1 only if i bq + off - span + 1 <= it
    return (lo, hi), (lo, nq - 1) if _sinks(cfg) else None


def _clamp(x, ranges):
    """Block index x clamped into the blocks to fetch (an index map: skipped steps refetch nothing)."""
    bounds, fetched = ranges
    lo, hi = fetched or bounds
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _in(x, bounds):
    lo, hi = bounds
    return (x >= lo) & (x <= hi)


def _when_live(x, ranges, mask_of, body):
    """body(mask_of()) only when block index x is inside the range (always when nothing is
    skipped), or inside the fetched range with a visible key (blocks that may hold sinks)."""
    bounds, fetched = ranges
    if fetched is None and all(isinstance(b, int) for b in bounds):
        body(mask_of())
    elif fetched is None:
        pl.when(_in(x, bounds))(lambda: body(mask_of()))
    else:
        @pl.when(_in(x, fetched))
        def _():
            mask = mask_of()
            pl.when(_in(x, bounds) | (jnp.max(mask.astype(jnp.int32)) > 0))(lambda: body(mask))


def _visible(qp, qs, qa, kp, ks, k0, h, cfg):
    """(bq, bk) bool: which keys query head h's queries see, or None when all are visible.

    qp, qs, qa (bq, 1) and kp, ks (1, bk) int32; k0 the index of the block's first key."""
    bq, bk = qp.shape[0], kp.shape[1]
    qp, qs, qa, kp, ks = (jnp.broadcast_to(x, (bq, bk)) for x in (qp, qs, qa, kp, ks))
    conds = []
    if cfg.causal:
        conds.append(kp <= qp)
    if cfg.band is not None:
        conds.append(cfg.band.mask(qp, qa, kp, h))
    if cfg.segmented:
        conds.append(ks == qs)
    if cfg.kv_padded:
        conds.append(k0 + iota((bq, bk), 1) < cfg.kv_len)
    return functools.reduce(jnp.logical_and, conds) if conds else None


def _logits(q, k, qd_ref, kd_ref, cfg):
    """(bq, bk) float32 logits: scale q k^T, plus qd_i - kd_j with a decay (refs (bq, 1), (1, bk))."""
    s = _dot(q, k, cfg, trans_b=True) * cfg.scale
    return s if qd_ref is None else s + (qd_ref[...] - kd_ref[...])


def _probs(q, k, qd_ref, kd_ref, lse, mask, cfg):
    """P = exp(s - L) (bq, bk) float32, zero where masked."""
    p = jnp.exp(_logits(q, k, qd_ref, kd_ref, cfg) - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _fwd_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, *refs, cfg):
    qd_ref, kd_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs if cfg.decay else (None, None, *refs)
    bq, bk = cfg.blocks[:2]
    h, i, j, nk = pl.program_id(1), pl.program_id(2), pl.program_id(3), cfg.padded[1] // cfg.blocks[1]
    mask_of = lambda: _visible(qp_ref[...], qs_ref[...], qa_ref[...], kp_ref[...], ks_ref[...], j * bk, h, cfg)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(mask):
        v = v_ref[...]  # (bk, V)
        s = _logits(q_ref[...], k_ref[...], qd_ref, kd_ref, cfg)  # (bq, bk)
        if mask is not None:
            s = jnp.where(mask, s, MASK)
        m = m_scr[...]  # (bq, 1)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if mask is not None:  # a row with nothing visible yet has m_new = MASK and s - m_new = 0
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l_scr[...] = l_scr[...] * alpha + p.sum(axis=1, keepdims=True)
        acc_scr[...] = acc_scr[...] * alpha + _dot(p.astype(v.dtype), v, cfg)
        m_scr[...] = m_new

    _when_live(j, _kv_range(i, bq, bk, nk, cfg), mask_of, step)

    @pl.when(j == nk - 1)
    def _store():
        l = l_scr[...]
        seen = l > 0
        l = jnp.where(seen, l, 1.0)
        o_ref[...] = jnp.where(seen, acc_scr[...] / l, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_scr[...] + jnp.log(l), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, do_ref, lse_ref, delta_ref,
               *refs, cfg):
    qd_ref, kd_ref, dq_ref, dq_scr = refs if cfg.decay else (None, None, *refs)
    bq, bk = cfg.blocks[4:]
    h, i, j, nk = pl.program_id(1), pl.program_id(2), pl.program_id(3), cfg.padded[1] // bk
    mask_of = lambda: _visible(qp_ref[...], qs_ref[...], qa_ref[...], kp_ref[...], ks_ref[...], j * bk, h, cfg)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def step(mask):
        k = k_ref[...]  # (bk, K)
        p = _probs(q_ref[...], k, qd_ref, kd_ref, lse_ref[...], mask, cfg)  # (bq, bk)
        ds = p * (_dot(do_ref[...], v_ref[...], cfg, trans_b=True) - delta_ref[...])
        dq_scr[...] += _dot(ds.astype(k.dtype), k, cfg)

    _when_live(j, _kv_range(i, bq, bk, nk, cfg), mask_of, step)

    @pl.when(j == nk - 1)
    def _store():
        dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, do_ref, lse_ref, delta_ref,
                *refs, cfg):
    qd_ref, kd_ref, dk_ref, dv_ref, dkd_ref, dk_scr, dv_scr, dkd_scr = \
        refs if cfg.decay else (None, None, *refs[:2], None, *refs[2:], None)
    bq, bk = cfg.blocks[2:4]
    j, r, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    nr, nq = cfg.heads[0] // cfg.heads[1], cfg.padded[0] // bq
    h = pl.program_id(1) * nr + r
    mask_of = lambda: _visible(qp_ref[...], qs_ref[...], qa_ref[...], kp_ref[...], ks_ref[...], j * bk, h, cfg)

    @pl.when((r == 0) & (i == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    if cfg.decay:  # d kd is per query head: its own sum over the query blocks of head r
        @pl.when(i == 0)
        def _init_decay():
            dkd_scr[...] = jnp.zeros(dkd_scr.shape, jnp.float32)

    def step(mask):
        q, do = q_ref[...], do_ref[...]  # (bq, K), (bq, V)
        p = _probs(q, k_ref[...], qd_ref, kd_ref, lse_ref[...], mask, cfg)  # (bq, bk)
        ds = p * (_dot(do, v_ref[...], cfg, trans_b=True) - delta_ref[...])
        dv_scr[...] += _dot(p.T.astype(do.dtype), do, cfg)  # (bk, V)
        dk_scr[...] += _dot(ds.T.astype(q.dtype), q, cfg)  # (bk, K)
        if cfg.decay:
            dkd_scr[...] -= ds.sum(axis=0, keepdims=True)  # (1, bk)

    _when_live(i, _q_range(j, bq, bk, nq, cfg), mask_of, step)

    if cfg.decay:
        @pl.when(i == nq - 1)
        def _store_decay():
            dkd_ref[...] = dkd_scr[...]

    @pl.when((r == nr - 1) & (i == nq - 1))
    def _store():
        dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, scratch, semantics, name, *args):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, scratch_shapes=[pltpu.VMEM(s, jnp.float32) for s in scratch],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), name=name,
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
    )(*args)


def _specs(bq, bk, q_index, kv_index):
    """BlockSpecs of q-like (B, T, H*D), kv-like (B, S, G*D) and row (B, T, 1), (B, 1, S),
    (B, H, T, 1), (B, H, 1, S) operands, from the grid's (batch, query block, query head) and (batch,
    key block, kv head) index functions."""
    q_blk = lambda d: pl.BlockSpec((None, bq, d), q_index)
    kv_blk = lambda d: pl.BlockSpec((None, bk, d), kv_index)
    q_row = pl.BlockSpec((None, bq, 1), lambda *ids: (*q_index(*ids)[:2], 0))
    kv_row = pl.BlockSpec((None, 1, bk), lambda *ids: (kv_index(*ids)[0], 0, kv_index(*ids)[1]))
    h_row = pl.BlockSpec((None, None, bq, 1), lambda *ids: (q_index(*ids)[0], q_index(*ids)[2],
                                                           q_index(*ids)[1], 0))
    hk_row = pl.BlockSpec((None, None, 1, bk), lambda *ids: (kv_index(*ids)[0], q_index(*ids)[2], 0,
                                                            kv_index(*ids)[1]))
    return q_blk, kv_blk, q_row, kv_row, h_row, hk_row


def _fq_specs(cfg, bq, bk):
    """Specs for the (B, H, T/bq, S/bk) grids of the forward and dQ kernels."""
    H, G = cfg.heads
    nk = cfg.padded[1] // bk
    kv_block = lambda i, j: _clamp(j, _kv_range(i, bq, bk, nk, cfg))
    return _specs(bq, bk, lambda b, h, i, j: (b, i, h),
                  lambda b, h, i, j: (b, kv_block(i, j), div(h, H // G)))


def _forward(q, k, v, qp, kp, qs, ks, qa, qd, kd, cfg):
    B, T, _ = q.shape  # padded; q (B, T, H*K), k (B, S, G*K), v (B, S, G*V)
    (H, G), (bq, bk) = cfg.heads, cfg.blocks[:2]
    K, V, S = q.shape[2] // H, v.shape[2] // G, k.shape[1]
    q_blk, kv_blk, q_row, kv_row, h_row, hk_row = _fq_specs(cfg, bq, bk)
    specs = [q_blk(K), kv_blk(K), kv_blk(V), q_row, kv_row, q_row, kv_row, q_row]
    args = [q, k, v, qp, kp, qs, ks, qa]
    if cfg.decay:  # qd (B, H, T, 1), kd (B, H, 1, S)
        specs, args = specs + [h_row, hk_row], args + [qd, kd]
    return _call(_fwd_kernel, cfg, (B, H, T // bq, S // bk), specs, [q_blk(V), h_row],
                 [jax.ShapeDtypeStruct((B, T, H * V), q.dtype),
                  jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32)],
                 [(bq, 1), (bq, 1), (bq, V)], ("parallel", "parallel", "parallel", "arbitrary"),
                 "flash_attention_tpu_fwd", *args)


def _backward(q, k, v, qp, kp, qs, ks, qa, qd, kd, do, lse, delta, cfg):
    B, T, _ = q.shape
    (H, G), R = cfg.heads, cfg.heads[0] // cfg.heads[1]
    K, V, S = q.shape[2] // H, v.shape[2] // G, k.shape[1]
    args, decay = [q, k, v, qp, kp, qs, ks, qa, do, lse, delta], [qd, kd] if cfg.decay else []
    bq, bk = cfg.blocks[4:]  # dQ: the forward's grid, accumulating over key blocks
    q_blk, kv_blk, q_row, kv_row, h_row, hk_row = _fq_specs(cfg, bq, bk)
    specs = [q_blk(K), kv_blk(K), kv_blk(V), q_row, kv_row, q_row, kv_row, q_row, q_blk(V), h_row, h_row]
    dq = _call(_dq_kernel, cfg, (B, H, T // bq, S // bk), specs + [h_row, hk_row][:len(decay)],
               q_blk(K), jax.ShapeDtypeStruct(q.shape, q.dtype), [(bq, K)],
               ("parallel", "parallel", "parallel", "arbitrary"), "flash_attention_tpu_dq", *args, *decay)
    bq, bk = cfg.blocks[2:4]  # dK/dV: grid (B, G, S/bk, R, T/bq), accumulating over r and i
    nq = T // bq
    q_block = lambda j, i: _clamp(i, _q_range(j, bq, bk, nq, cfg))
    q_blk, kv_blk, q_row, kv_row, h_row, hk_row = _specs(
        bq, bk, lambda b, g, j, r, i: (b, q_block(j, i), g * R + r),
        lambda b, g, j, r, i: (b, j, g))
    specs = [q_blk(K), kv_blk(K), kv_blk(V), q_row, kv_row, q_row, kv_row, q_row, q_blk(V), h_row, h_row]
    out_specs, scratch = [kv_blk(K), kv_blk(V)], [(bk, K), (bk, V)]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if cfg.decay:  # d kd (B, H, 1, S): the block of query head g R + r
        specs, out_specs, scratch = specs + [h_row, hk_row], out_specs + [hk_row], scratch + [(1, bk)]
        out_shape.append(jax.ShapeDtypeStruct(kd.shape, jnp.float32))
    dk, dv, *dkd = _call(_dkv_kernel, cfg, (B, G, S // bk, R, nq), specs, out_specs, out_shape, scratch,
                         ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
                         "flash_attention_tpu_dkv", *args, *decay)
    return dq, dk, dv, *dkd


def _row_sums(o, do, cfg):
    """D = rowsum(dO * O) (B, H, T, 1) of o, do (B, T, H*V)."""
    B, T, H = o.shape[0], o.shape[1], cfg.heads[0]
    prod = o.astype(jnp.float32) * do.astype(jnp.float32)  # (B, T, H*V)
    return jnp.moveaxis(prod.reshape(B, T, H, -1).sum(-1), 2, 1)[..., None]


_flash = flash_vjp(_forward, _backward, _row_sums)


def flash_attention_tpu(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G V"],
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    tokens: Tokens | None = None,
    band: Band | None = None,
    causal: bool = True,
    scale: float | None = None,
    decay: Float[Array, "B T H"] | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> Float[Array, "B T H V"]:
    """Same arguments and result as attention_reference; differentiable in q, k, v and the decay.
    The band is static here: each field None, a number, or a tuple per query head.

    interpret=None runs the TPU interpreter everywhere but on a TPU.
    """
    B, T, H, K = q.shape
    S, G, V = k.shape[1], k.shape[2], v.shape[-1]
    tokens = Tokens() if tokens is None else tokens
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    blocks = block_sizes or BlockSizes()
    fitted, Tp, Sp = fit_blocks(blocks, T, S, least=8)
    if not interpret:
        for f, b in zip(dataclasses.fields(blocks)[1::2], fitted[1::2]):
            if b % 128 and b != Sp:
                raise ValueError(f"BlockSizes.{f.name}={b}: key blocks must be multiples of 128 on "
                                 f"TPU unless they cover the whole (padded) S={Sp}")
    Kp, Vp = (d if interpret else -(-d // 128) * 128 for d in (K, V))
    cfg = _Config(
        scale=K ** -0.5 if scale is None else float(scale), causal=causal,
        band=KernelBand.of(band, H), segmented=segment_ids is not None,
        decay=decay is not None, kv_len=S, kv_padded=Sp != S,
        q_offset=S - T if tokens.q_positions is None and tokens.kv_positions is None else None,
        heads=(H, G), blocks=fitted, padded=(Tp, Sp), interpret=interpret,
        exact=q.dtype == jnp.float32)
    qp, kp, qs, ks, qa = mask_rows(T, S, segment_ids, tokens)
    q_row = lambda x: jnp.pad(jnp.broadcast_to(x, (B, T)).astype(jnp.int32), ((0, 0), (0, Tp - T)))
    kv_row = lambda x: jnp.pad(jnp.broadcast_to(x, (B, S)).astype(jnp.int32), ((0, 0), (0, Sp - S)))
    pad = lambda x, n, d: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d - x.shape[3])))
    heads = lambda x: x.reshape(*x.shape[:2], -1)  # (B, T, H, D) -> (B, T, H*D), free
    qd, kd = decay_rows(decay, tokens, Tp, Sp)
    qd, kd = (None, None) if decay is None else (qd[..., None], kd[:, :, None])  # (B, H, Tp, 1), (B, H, 1, Sp)
    o = _flash(heads(pad(q, Tp, Kp)), heads(pad(k, Sp, Kp)), heads(pad(v, Sp, Vp)),
               q_row(qp)[..., None], kv_row(kp)[:, None], q_row(qs)[..., None], kv_row(ks)[:, None],
               q_row(qa)[..., None], qd, kd, cfg)
    return o.reshape(B, Tp, H, Vp)[:, :T, :, :V]
