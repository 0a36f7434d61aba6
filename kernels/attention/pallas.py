"""Flash attention in Pallas: FlashAttention-2 (Dao, 2023, arXiv:2307.08691), forward and backward.

Forward, for one block of queries i against key blocks j (online softmax, logits s = scale q k^T):

    m_i^(j) = max(m_i^(j-1), rowmax(s_ij))                        running row maximum
    l_i^(j) = exp(m_i^(j-1) - m_i^(j)) l_i^(j-1) + rowsum(exp(s_ij - m_i^(j)))
    O_i^(j) = exp(m_i^(j-1) - m_i^(j)) O_i^(j-1) + exp(s_ij - m_i^(j)) V_j
    O_i = O_i^(last) / l_i^(last),   L_i = m_i + log l_i           (logsumexp, saved)

Backward, with P_ij = exp(s_ij - L_i) recomputed from L (never stored):

    D_i = rowsum(dO_i * O_i),   dP_ij = dO_i V_j^T,   dS_ij = P_ij * (dP_ij - D_i)
    dQ_i = scale sum_j dS_ij K_j,   dK_j = scale sum_i dS_ij^T Q_i,   dV_j = sum_i P_ij^T dO_i

A decay (reference.py; Forgetting attention's cumulative log forget gate) adds qd_i - kd_j to the
logits s_ij, per query head (with GQA too: kd is per query head, not per kv head). Its gradient:
d kd_j = -sum_i dS_ij (summed in the dK/dV kernel over its query blocks, per query head), d qd_i = 0
(a per-query shift cancels in the softmax; qd only keeps the logits small).

Code names: `m`, `l`, `acc` (unnormalised O), `lse` (L), `delta` (D), `p` (P), `ds` (dS), `qd`/`kd`
(the decay of the queries / keys, rows (bq,) / (bk,) of (B, H, T) / (B, H, S) float32), `qa` (the
position where each query's document starts, (bq,)). Masks are the reference's (reference.py): key j
is visible from query i iff kp_j <= qp_i (causal), the segment ids agree, and j is in query head h's
band (`KernelBand`, of masks.Band: window, sinks, dilation and growth, static, each shared or per head; a
per-head value is picked by a chain of selects on h); a query that sees no key returns zeros.
Grouped-query attention: query head h reads kv head h // R (R = H / G) through the BlockSpec index
map, so K/V are never repeated; the dK/dV kernel runs once per kv head and sums over its R query
heads inside the kernel.

Backend. On GPU the kernel is lowered with the Triton backend (pltriton.CompilerParams), on
purpose, although JAX 0.10 sends a plain pallas_call to Mosaic GPU by default and the Pallas
changelog (0.11) deprecates the Triton backend. Mosaic GPU is the road to Hopper's TMA, wgmma and
warp specialisation, but its kernels are written at that level (plgpu.kernel, SMEM refs,
barriers, explicit wgmma on 64-row tiles, which need sm_90+) with an API that still changes between
releases: this plain-jnp kernel does not lower there (jax 0.10.2: "Unimplemented primitive in
Pallas Mosaic GPU lowering: dot_general"). The grid + BlockSpec kernel in plain jnp runs unchanged
in interpret mode, where the tests check it, and lowers through Triton, which emits wgmma for these
dots on Hopper by itself and also runs on Ampere; `jax.jit(...).trace(...).lower(
lowering_platforms=("cuda",))` lowers all three kernels on a CPU-only machine. A Mosaic GPU
variant is the next step for speed (benchmarks/kernels.py shows the gap to cuDNN). The TPU kernels
are in pallas_tpu.py.

Departures from the paper and the official kernel:
- softmax in base 2: logits are multiplied by scale * log2(e) and exp2/log2 are used (the same
  function; `lse` is stored in base 2 and only ever read back by these kernels);
- fully masked blocks are skipped: with kv_positions=None (keys at their index) the key-block range
  of a query block comes from its min/max query position (causal bounds the end, the widest span
  window x dilation the start); the dK/dV kernel also narrows its query-block range when
  q_positions is None. With sinks, the blocks outside that range that may hold a sink (keys before
  the block's last document start + sinks; for dK/dV every later query block) are visited too, each
  behind a lax.cond on its mask, so only those with a visible key cost a dot. A span that grows
  with the position bounds no start. With explicit kv_positions every block is visited and masked;
- dQ has its own kernel (one program per query block, looping over key blocks) instead of the
  paper's atomic adds, so the backward is deterministic; D is computed in XLA;
- T, S and the head dims are padded (to the block sizes and to a power of two >= 16, which Triton's
  dot needs); padded keys are masked, padded queries and channels are sliced off.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from kernels.attention.masks import NO_WINDOW, Band, Tokens
from kernels.attention.reference import default_positions, doc_positions
from kernels.pallas_blocks import dot, fit_block
from kernels.x64 import div, fori_loop

LOG2E = math.log2(math.e)
MASK = -1e30  # finite "minus infinity" for masked logits: keeps exp2 and max free of inf - inf


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per block (powers of two) for the forward, dK/dV and dQ kernels, and GPU launch knobs.

    Blocks larger than the (padded) sequence are shrunk to it, never below 16.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    num_warps: int | None = None  # None: 4 for head dims <= 64, else 8
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self)[:6]:
            b = getattr(self, f.name)
            if b < 1 or b & (b - 1):
                raise ValueError(f"BlockSizes.{f.name}={b} must be a power of two")


BLOCK_SIZES = {
    # Triton flash-attention settings for Hopper (128 x 64 forward tiles, narrow backward tiles that
    # keep the dK/dV accumulators in registers); not yet tuned on this kernel.
    "gpu": BlockSizes(block_q=128, block_k=64, block_q_dkv=32, block_k_dkv=64, block_q_dq=64,
                      block_k_dq=32, num_stages=2),
    # Interpret mode (CPU): its cost is per block, so few large blocks.
    "cpu": BlockSizes(),
}


def default_block_sizes(backend: str | None = None) -> BlockSizes:
    return BLOCK_SIZES.get(backend or jax.default_backend(), BLOCK_SIZES["cpu"])


def supports(q, k, v) -> bool:
    """Whether impl="auto" runs this kernel on GPU (otherwise it runs the XLA reference).

    Not for decode-sized calls (T <= 16 queries): the kernel does not split S across programs
    (no flash-decoding), so B * H programs would each scan the whole cache, while XLA's (B, H, T, S)
    scores are small there. A heuristic, not yet measured.
    """
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    return (all(x.dtype in dtypes for x in (q, k, v)) and max(q.shape[-1], v.shape[-1]) <= 256
            and q.shape[1] > 16)


def _pick(values, h):
    """values[h] for a traced head index h: the one value when all heads share it, else a chain of
    selects over the static per-head values (scalar ops, no table in memory)."""
    if len(set(values)) == 1:
        return values[0]
    dtype = np.float32 if isinstance(values[0], float) else np.int32
    out = dtype(values[0])
    for i, x in enumerate(values[1:], 1):
        out = jnp.where(h == i, dtype(x), out)
    return out


@dataclasses.dataclass(frozen=True)
class KernelBand:
    """A static masks.Band as the kernels read it, per query head: span_h = window_h * dilation_h
    (int32-capped; None: no window and no growth), dilation, sinks and growth (None: no head has one).
    Each is a tuple of H values, equal when the heads share one."""

    span: tuple[int, ...] | tuple[float, ...] | None  # floats with growth (compared in float32)
    dilation: tuple[int, ...] | None
    sinks: tuple[int, ...] | None
    growth: tuple[float, ...] | None

    @staticmethod
    def of(band: Band | None, H: int) -> "KernelBand | None":
        """The kernels' form of a static band (each field a number or a tuple per head), or None when
        it is every key."""
        heads = lambda x: None if x is None else (tuple(x) if isinstance(x, (tuple, list)) else (x,) * H)
        window, sinks, dilation, growth = (heads(x) for x in (Band() if band is None else band).terms())
        dil = dilation or (1,) * H
        span = None
        if window is not None or growth is not None:
            window = window or (NO_WINDOW,) * H
            span = tuple(min(int(w) * int(d), 2 ** 31 - 1) for w, d in zip(window, dil))
            if growth is not None:  # compared as float32, as in the reference
                span = tuple(float(np.float32(w) * np.float32(d)) for w, d in zip(window, dil))
        if span is None and dilation is None:
            return None  # sinks alone add nothing to every key
        return KernelBand(span, None if dilation is None else tuple(int(d) for d in dilation),
                          None if sinks is None else tuple(int(x) for x in sinks),
                          None if growth is None else tuple(float(x) for x in growth))

    @property
    def max_span(self) -> int | None:
        """The widest span of any head, for skipping key blocks before it; None when unbounded."""
        if self.span is None or self.growth is not None or max(self.span) >= NO_WINDOW:
            return None
        return max(self.span)

    def mask(self, qp, qstart, kp, h):
        """Whether key positions kp are in query head h's band for queries at qp whose documents
        start at qstart (broadcasting int32 arrays)."""
        d = qp - kp
        band = None if self.dilation is None else d % _pick(self.dilation, h) == 0
        if self.span is not None:
            if self.growth is None:  # d < window * dilation for the d dilation keeps: d // dilation < window
                near = d < _pick(self.span, h)
            else:
                n = (qp - qstart + 1).astype(jnp.float32)  # the query's length in its document
                near = d.astype(jnp.float32) < _pick(self.span, h) + _pick(self.growth, h) * n
            band = near if band is None else band & near
        if self.sinks is not None:
            band = band | (kp - qstart < _pick(self.sinks, h))
        return band


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    causal: bool
    band: KernelBand | None
    segmented: bool
    decay: bool  # qd, kd are inputs (and d kd an output of the dK/dV kernel)
    kv_len: int  # S before padding: keys at index >= kv_len are padding
    kv_padded: bool
    kv_is_index: bool  # kv_positions is None: key j sits at position j
    q_offset: int | None  # q_positions is None: query t sits at position t + q_offset
    blocks: tuple[int, ...]  # (bq, bk, bq_dkv, bk_dkv, bq_dq, bk_dq) after fitting
    num_warps: int
    num_stages: int
    interpret: bool
    exact: bool  # float32 inputs: ask for full-precision dots (no TF32) on GPU
    dtype: None = None  # pallas_blocks.dot takes the operands as they are (each cast where it is made)


def _visible(qp, qs, qa, kp, ks, k0, bk, h, cfg):
    """(bq, bk) bool: which keys query head h's queries see, or None when all are visible."""
    conds = []
    if cfg.causal:
        conds.append(kp[None, :] <= qp[:, None])
    if cfg.band is not None:
        conds.append(cfg.band.mask(qp[:, None], qa[:, None], kp[None, :], h))
    if cfg.segmented:
        conds.append(ks[None, :] == qs[:, None])
    if cfg.kv_padded:
        conds.append((k0 + jnp.arange(bk, dtype=jnp.int32))[None, :] < cfg.kv_len)
    return functools.reduce(jnp.logical_and, conds) if conds else None


def _any(mask):
    """Whether a (bq, bk) mask (None: all visible) lets any key through, a scalar bool."""
    return True if mask is None else jnp.max(mask.astype(jnp.int32)) > 0


def _blocks(lo, hi, extra, step, mask_of, init):
    """carry = step(j, carry, mask_of(j)) over the blocks [lo, hi), after the blocks [extra[0],
    extra[1]) (None: none), where a block whose mask lets nothing through is skipped (lax.cond).
    The extra blocks are those outside the window that may hold attention sinks."""
    def guarded(j, carry):
        mask = mask_of(j)
        return lax.cond(_any(mask), lambda c: step(j, c, mask), lambda c: c, carry)

    carry = init if extra is None else fori_loop(extra[0], extra[1], guarded, init)
    return fori_loop(lo, hi, lambda j, c: step(j, c, mask_of(j)), carry)


def _read(ref, *index):
    """ref[index], or None for an absent input (no decay)."""
    return None if ref is None else ref[index]


def _logits(q, k, qd, kd, cfg):
    """(bq, bk) float32 base-2 logits: scale q k^T, plus qd_i - kd_j with a decay (qd, kd not None)."""
    s = dot(q, k, (1, 1), cfg) * (cfg.scale * LOG2E)
    return s if qd is None else s + (qd[:, None] - kd[None, :]) * LOG2E


def _probs(q, k, qd, kd, lse, mask, cfg):
    """P = exp2(s - L) (bq, bk) float32, zero where masked."""
    p = jnp.exp2(_logits(q, k, qd, kd, cfg) - lse[:, None])
    return p if mask is None else jnp.where(mask, p, 0.0)


def _kv_block_range(qp, qa, bk, nk, cfg):
    """Key blocks [lo, hi) that can hold a visible key for queries at positions qp, and the blocks
    before lo that can hold one of their sinks ((0, n), or None)."""
    lo, hi, sink_blocks = 0, nk, None
    if cfg.kv_is_index and cfg.causal:
        hi = jnp.clip(div(jnp.max(qp) + bk, bk), 0, nk)
    span = None if cfg.band is None else cfg.band.max_span
    if cfg.kv_is_index and span is not None:
        lo = div(jnp.clip(jnp.min(qp) - span + 1, 0, nk * bk), bk)
        if cfg.band.sinks is not None:  # keys at positions < (a query's document start) + sinks
            sink_blocks = (0, jnp.minimum(div(jnp.clip(jnp.max(qa) + max(cfg.band.sinks) - 1, -1, nk * bk) + bk,
                                              bk), lo))
    return lo, hi, sink_blocks


def _q_block_range(k0, bk, bq, nq, cfg):
    """Query blocks [lo, hi) that can see a key of the block starting at k0, and the blocks after
    hi that can see one as a sink ((hi, nq), or None; _blocks skips those whose mask is empty)."""
    lo, hi, sink_blocks = 0, nq, None
    if cfg.kv_is_index and cfg.q_offset is not None:
        if cfg.causal:  # query t sees key k0 only if t + q_offset >= k0
            lo = div(jnp.clip(k0 - cfg.q_offset, 0, nq * bq), bq)
        span = None if cfg.band is None else cfg.band.max_span
        if span is not None:  # and key k0 + bk - 1 only if t + q_offset < k0 + bk - 1 + span
            hi = jnp.clip(div(k0 + bk - 1 + span - cfg.q_offset + bq - 1, bq), lo, nq)
            if cfg.band.sinks is not None:
                sink_blocks = (hi, nq)
    return lo, hi, sink_blocks


def _fwd_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, *refs, cfg):
    qd_ref, kd_ref, o_ref, lse_ref = refs if cfg.decay else (None, None, *refs)
    bq, bk = cfg.blocks[:2]
    q, qp, qs, qa, qd = q_ref[...], qp_ref[...], qs_ref[...], qa_ref[...], _read(qd_ref, ...)  # (bq, K), (bq,) x 4
    h = pl.program_id(2)

    def mask_of(j):
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        return _visible(qp, qs, qa, kp_ref[sl], ks_ref[sl], j * bk, bk, h, cfg)

    def step(j, carry, mask):
        acc, m, l = carry  # (bq, V), (bq,), (bq,)
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[sl, :], v_ref[sl, :]  # (bk, K), (bk, V)
        s = _logits(q, k, qd, _read(kd_ref, sl), cfg)  # (bq, bk)
        if mask is not None:
            s = jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:  # a row with nothing visible yet has m_new = MASK and s - m_new = 0
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, (1, 0), cfg)
        return acc, m_new, l * alpha + p.sum(axis=1)

    init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq,), MASK, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = _blocks(*_kv_block_range(qp, qa, bk, k_ref.shape[0] // bk, cfg), step, mask_of, init)
    seen = l > 0
    l = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, do_ref, lse_ref, delta_ref,
               *refs, cfg):
    qd_ref, kd_ref, dq_ref = refs if cfg.decay else (None, None, *refs)
    bq, bk = cfg.blocks[4:]
    q, do, qp, qs, qa = q_ref[...], do_ref[...], qp_ref[...], qs_ref[...], qa_ref[...]  # (bq, K), (bq, V), ...
    qd = _read(qd_ref, ...)  # (bq,) or None
    lse, delta = lse_ref[...], delta_ref[...]  # (bq,)
    h = pl.program_id(2)

    def mask_of(j):
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        return _visible(qp, qs, qa, kp_ref[sl], ks_ref[sl], j * bk, bk, h, cfg)

    def step(j, dq, mask):
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[sl, :], v_ref[sl, :]  # (bk, K), (bk, V)
        p = _probs(q, k, qd, _read(kd_ref, sl), lse, mask, cfg)  # (bq, bk)
        ds = p * (dot(do, v, (1, 1), cfg) - delta[:, None])  # (bq, bk)
        return dq + dot(ds.astype(k.dtype), k, (1, 0), cfg)

    dq = _blocks(*_kv_block_range(qp, qa, bk, k_ref.shape[0] // bk, cfg), step, mask_of,
                 jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, qs_ref, ks_ref, qa_ref, do_ref, lse_ref, delta_ref,
                *refs, cfg):
    qd_ref, kd_ref, dk_ref, dv_ref, dkd_ref = refs if cfg.decay else (None, None, *refs, None)
    bq, bk = cfg.blocks[2:4]
    k, v, kp, ks = k_ref[...], v_ref[...], kp_ref[...], ks_ref[...]  # (bk, K), (bk, V), (bk,), (bk,)
    k0, g = pl.program_id(0) * bk, pl.program_id(2)  # (program ids are read outside the loops)
    R = q_ref.shape[1]
    blocks = _q_block_range(k0, bk, bq, q_ref.shape[0] // bq, cfg)

    def head(r, carry):  # the R query heads that share this kv head
        kd = _read(kd_ref, r, slice(None))  # (bk,) or None
        h = g * R + r

        def mask_of(i):
            sl = pl.ds(pl.multiple_of(i * bq, bq), bq)
            return _visible(qp_ref[sl], qs_ref[sl], qa_ref[sl], kp, ks, k0, bk, h, cfg)

        def step(i, carry, mask):
            dk, dv, *dkd = carry  # (bk, K), (bk, V), and d kd (bk,) with a decay
            sl = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q, do = q_ref[sl, r, :], do_ref[sl, r, :]  # (bq, K), (bq, V)
            p = _probs(q, k, _read(qd_ref, r, sl), kd, lse_ref[r, sl], mask, cfg)  # (bq, bk)
            ds = p * (dot(do, v, (1, 1), cfg) - delta_ref[r, sl][:, None])
            grads = (dk + dot(ds.astype(q.dtype), q, (0, 0), cfg),
                     dv + dot(p.astype(do.dtype), do, (0, 0), cfg))
            return grads if kd is None else (*grads, dkd[0] - ds.sum(axis=0))

        if kd is None:
            return _blocks(*blocks, step, mask_of, carry)
        dk, dv, dkd = _blocks(*blocks, step, mask_of, (*carry, jnp.zeros((bk,), jnp.float32)))
        dkd_ref[r, :] = dkd
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = fori_loop(0, R, head, init)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, name, *args):
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=cfg.interpret, name=name,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*args)


def _forward(q, k, v, qp, kp, qs, ks, qa, qd, kd, cfg):
    B, T, H, K = q.shape  # padded
    S, G, V = k.shape[1], k.shape[2], v.shape[-1]
    R, bq = H // G, cfg.blocks[0]  # the kernel slices its key blocks out of the whole K/V
    q_blk = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
    kv_all = lambda d: pl.BlockSpec((None, S, None, d), lambda i, b, h: (b, 0, h // R, 0))
    q_row = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    kv_row = pl.BlockSpec((None, S), lambda i, b, h: (b, 0))
    h_row = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    specs = [q_blk(K), kv_all(K), kv_all(V), q_row, kv_row, q_row, kv_row, q_row]
    args = [q, k, v, qp, kp, qs, ks, qa]
    if cfg.decay:  # qd (B, H, T), kd (B, H, S): the query head's rows
        specs, args = specs + [h_row, pl.BlockSpec((None, None, S), lambda i, b, h: (b, h, 0))], args + [qd, kd]
    return _call(_fwd_kernel, cfg, (T // bq, B, H), specs, [q_blk(V), h_row],
                 [jax.ShapeDtypeStruct((B, T, H, V), q.dtype),
                  jax.ShapeDtypeStruct((B, H, T), jnp.float32)], "flash_attention_fwd", *args)


def _backward(q, k, v, qp, kp, qs, ks, qa, qd, kd, do, lse, delta, cfg):
    B, T, H, K = q.shape
    S, G, V = k.shape[1], k.shape[2], v.shape[-1]
    R = H // G
    bq = cfg.blocks[4]  # dQ: one program per query block of one head, slicing key blocks itself
    q_blk = lambda d: pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
    kv_all = lambda d: pl.BlockSpec((None, S, None, d), lambda i, b, h: (b, 0, h // R, 0))
    q_row, h_row = (pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                    pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)))
    kv_row = pl.BlockSpec((None, S), lambda i, b, h: (b, 0))
    specs = [q_blk(K), kv_all(K), kv_all(V), q_row, kv_row, q_row, kv_row, q_row, q_blk(V), h_row, h_row]
    args = [q, k, v, qp, kp, qs, ks, qa, do, lse, delta]
    decay = [qd, kd] if cfg.decay else []
    if cfg.decay:
        specs.extend([h_row, pl.BlockSpec((None, None, S), lambda i, b, h: (b, h, 0))])
    dq = _call(_dq_kernel, cfg, (T // bq, B, H), specs, q_blk(K), jax.ShapeDtypeStruct(q.shape, q.dtype),
               "flash_attention_dq", *args, *decay)
    bq, bk = cfg.blocks[2:4]  # dK/dV: one program per key block of one kv head, all its R q heads
    q_all = lambda d: pl.BlockSpec((None, T, R, d), lambda j, b, g: (b, 0, g, 0))
    kv_blk = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, b, g: (b, j, g, 0))
    q_row, h_row = (pl.BlockSpec((None, T), lambda j, b, g: (b, 0)),
                    pl.BlockSpec((None, R, T), lambda j, b, g: (b, g, 0)))
    kv_row = pl.BlockSpec((None, bk), lambda j, b, g: (b, j))
    specs = [q_all(K), kv_blk(K), kv_blk(V), q_row, kv_row, q_row, kv_row, q_row, q_all(V), h_row, h_row]
    out_specs = [kv_blk(K), kv_blk(V)]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if cfg.decay:  # kd and d kd: the R query heads' rows of this key block
        kd_blk = pl.BlockSpec((None, R, bk), lambda j, b, g: (b, g, j))
        specs, out_specs = specs + [h_row, kd_blk], out_specs + [kd_blk]
        out_shape.append(jax.ShapeDtypeStruct(kd.shape, jnp.float32))
    dk, dv, *dkd = _call(_dkv_kernel, cfg, (S // bk, B, G), specs, out_specs, out_shape,
                         "flash_attention_dkv", *args, *decay)
    return dq, dk, dv, *dkd


def flash_vjp(forward, backward, row_sums):
    """The differentiable call of a flash-attention kernel family (this file's GPU kernels and
    pallas_tpu.py's TPU ones): forward(q, k, v, qp, kp, qs, ks, qa, qd, kd, cfg) -> (o, lse),
    backward(the same inputs but cfg, do, lse, D, cfg) -> (dq, dk, dv[, d kd]), row_sums(o, do, cfg)
    -> D = rowsum(dO * O) in the kernels' layout. The mask rows (positions, segments, document
    starts) get no gradient; qd gets zero (a per-query shift cancels in the softmax)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
    def flash(q, k, v, qp, kp, qs, ks, qa, qd, kd, cfg):
        return forward(q, k, v, qp, kp, qs, ks, qa, qd, kd, cfg)[0]

    def flash_fwd(*args):
        o, lse = forward(*args)
        return o, (*args[:-1], o, lse)

    def flash_bwd(cfg, res, do):
        *ins, o, lse = res
        dq, dk, dv, *dkd = backward(*ins, do.astype(o.dtype), lse, row_sums(o, do, cfg), cfg)
        qd = ins[8]
        return dq, dk, dv, *(None,) * 5, *((jnp.zeros_like(qd), dkd[0]) if cfg.decay else (None, None))

    flash.defvjp(flash_fwd, flash_bwd)
    return flash


_flash = flash_vjp(_forward, _backward, lambda o, do, cfg: jnp.einsum(
    "BTHV,BTHV->BHT", o.astype(jnp.float32), do.astype(jnp.float32)))  # D (B, H, T)


def fit_blocks(blocks, T: int, S: int, least: int = 16):
    """The six block sizes of a BlockSizes (block_q, block_k, block_q_dkv, ...: query blocks fitted to T,
    key blocks to S, at least `least`) and T, S padded to the largest of each: (fitted, Tp, Sp)."""
    fitted = tuple(fit_block(getattr(blocks, f.name), T if f.name.startswith("block_q") else S, least)
                   for f in dataclasses.fields(blocks)[:6])
    Tp, Sp = -(-T // max(fitted[::2])) * max(fitted[::2]), -(-S // max(fitted[1::2])) * max(fitted[1::2])
    return fitted, Tp, Sp


def mask_rows(T, S, segment_ids, tokens: Tokens):
    """The rows the masks compare, (1 or B, T) for queries and (1 or B, S) for keys: positions
    (by default the queries are the last T of the S keys), documents (kv_segment_ids alone mask
    nothing, as in the reference) and the position where each query's document starts (sinks and
    growth count from it; reference.doc_positions)."""
    qp, kp = default_positions(T, S, tokens)
    qa = qp - doc_positions(T, S, tokens, segment_ids, qp)
    if segment_ids is None:
        return qp, kp, jnp.zeros((1, T), jnp.int32), jnp.zeros((1, S), jnp.int32), qa
    return qp, kp, segment_ids, segment_ids if tokens.kv_segment_ids is None else tokens.kv_segment_ids, qa


def decay_rows(decay, tokens: Tokens, Tp: int, Sp: int):
    """The decay of the queries (B, H, Tp) and of the keys (B, H, Sp) float32, padded; (None, None)
    without one."""
    if decay is None:
        return None, None
    rows = lambda x, n: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, n - x.shape[1]), (0, 0))).transpose(0, 2, 1)
    return rows(decay, Tp), rows(decay if tokens.kv_decay is None else tokens.kv_decay, Sp)


def flash_attention(
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

    interpret=None runs the kernel in interpret mode everywhere but on GPU.
    """
    B, T, H, K = q.shape
    S, V = k.shape[1], v.shape[-1]
    tokens = Tokens() if tokens is None else tokens
    backend = jax.default_backend()
    blocks = block_sizes or default_block_sizes(backend)
    fitted, Tp, Sp = fit_blocks(blocks, T, S)
    Kp, Vp = max(16, pl.next_power_of_2(K)), max(16, pl.next_power_of_2(V))
    cfg = _Config(
        scale=K ** -0.5 if scale is None else float(scale), causal=causal,
        band=KernelBand.of(band, H), segmented=segment_ids is not None,
        decay=decay is not None, kv_len=S, kv_padded=Sp != S,
        kv_is_index=tokens.kv_positions is None, q_offset=S - T if tokens.q_positions is None else None,
        blocks=fitted, num_warps=blocks.num_warps or (4 if max(Kp, Vp) <= 64 else 8),
        num_stages=blocks.num_stages, interpret=backend != "gpu" if interpret is None else interpret,
        exact=q.dtype == jnp.float32)
    qp, kp, qs, ks, qa = mask_rows(T, S, segment_ids, tokens)
    row = lambda x, n, mode: jnp.pad(jnp.broadcast_to(x, (B, x.shape[1])).astype(jnp.int32),
                                     ((0, 0), (0, n - x.shape[1])), mode=mode)
    pad = lambda x, n, d: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d - x.shape[3])))
    qd, kd = decay_rows(decay, tokens, Tp, Sp)  # (B, H, Tp), (B, H, Sp)
    # Padded queries repeat the last position, so a block's min/max position (block skipping) holds.
    o = _flash(pad(q, Tp, Kp), pad(k, Sp, Kp), pad(v, Sp, Vp), row(qp, Tp, "edge"),
               row(kp, Sp, "constant"), row(qs, Tp, "constant"), row(ks, Sp, "constant"), row(qa, Tp, "edge"),
               qd, kd, cfg)
    return o[:, :T, :, :V]
