"""Gated linear attention in Pallas (Yang et al., 2024, arXiv:2312.06635, the chunkwise form),
forward and backward, fused over chunks: one program per (value block, batch row, head) walks the
sequence chunk by chunk and keeps the (K, V) state on chip, as flash-linear-attention's
`fused_chunk` kernels do. With chunks of C tokens, b_i = sum of g over the chunk up to token i and
q' = scale q:

    O_[n] = (Q' ⊙ e^{b}) S_[n-1] + A V,    A_ij = [j <= i] sum_k q'_ik k_jk e^{b_ik - b_jk}
    S_[n] = diag(e^{b_{C-1}}) S_[n-1] + (K ⊙ e^{b_{C-1} - b})^T V

Backward, two kernels, with dA = dO V^T (C, C) masked like A:

    dQ kernel, chunks in order, recomputing S_[n-1]:
        dq_i = scale (e^{b_i} ⊙ (S_[n-1] do_i) + sum_{j <= i} dA_ij k_j ⊙ e^{b_i - b_j})
    dK/dV kernel, chunks in reverse, carrying dS_[n] from the final state's cotangent:
        dk_j = e^{b_{C-1} - b_j} ⊙ (dS_[n] v_j) + sum_{i >= j} dA_ij q'_i ⊙ e^{b_i - b_j}
        dV = (K ⊙ e^{b_{C-1} - b}) dS_[n] + A^T dO
        dS_[n-1] = diag(e^{b_{C-1}}) dS_[n] + (Q' ⊙ e^{b})^T dO      (dS_[-1]: d initial_state)

No per-chunk state is stored: the memory is that of the inputs. The gate gradient needs no state
either: q and k meet the gates only as q_t e^{B_t} and k_s e^{-B_s} (B the cumulative log-decay),
so with dB_t = q_t ⊙ dq_t - k_t ⊙ dk_t (+ rowsum(dS_T ⊙ S_T) at the last token),
dg_t = sum_{s >= t} dB_s, the sum kept inside t's document (later documents add exactly zero) and
dg = 0 at a document start, where the gate multiplies a zero state.

Code names: `St` is S^T (V, K), kept transposed so that a per-channel decay is a row that
broadcasts; `b` the chunk-local cumulative log-decay, `qd` = Q' ⊙ e^{b}, `kd` = K ⊙ e^{b_{C-1} - b}
(both masked by documents), `decay` = e^{b_{C-1}}, `E` the scalar gate's (C, C) e^{b_i - b_j}.

Two gate kinds, one kernel: per-channel g (B, T, H, K) (GLA) and one log-decay per (token, head)
g (B, T, H) (retention with g = log gamma, linear attention with g = 0, and Mamba-2's SSD, see
kernels/ssd/pallas.py). Per channel, e^{b_i - b_j} has no matrix form: the kernel loops over the
chunk's keys j (as fla's intra-sub-chunk kernel), computing e^{b_i - b_j} for all queries i >= j
at once, with the exponent masked before exp, so nothing overflows for any gate. With a scalar
gate the decay is the (C, C) tile e^{b_i - b_j} and every product is a matmul. Queries and keys
may have G heads shared by H / G value heads (head h reads h // (H / G)), through the BlockSpec.

Documents: doc(t) counts the document starts up to t. A also needs doc(i) == doc(j); the carried
state is seen only by tokens of the document of the token before the chunk, kept only if the
chunk holds no start, and updated only by keys of the chunk's last document (as chunk.py).

Backend. On GPU the kernels are lowered through Triton (pltriton.CompilerParams), for the reason
kernels/attention/pallas.py gives: this plain-jnp grid + BlockSpec kernel does not lower to Mosaic
GPU in jax 0.10.2 (no dot_general rule there), it runs unchanged in interpret mode where the tests
check it, and Triton picks the tensor-core instructions for its dots itself. Without a GPU,
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` checks that every kernel lowers to
Triton IR; that Triton compiles and runs it is checked only by the tests marked gpu, not yet run.
The TPU kernels are in pallas_tpu.py.

Departures from the paper and from fla:
- one level of chunking, C = 16 tokens per step for per-channel gates (fla: 64-token chunks split
  into 16-token sub-chunks joined by matmuls through a reference point); C = 64 for a scalar gate;
- the chunk-local cumulative gates b are computed in XLA (as fla's chunk_local_cumsum) and the
  gate gradient's suffix sum runs in XLA after the kernels;
- dQ (and dK) of each value block are summed over the value blocks in XLA (fla does the same over
  its key/value blocks), and over the H / G heads sharing a query/key head;
- the pairwise exponentials are computed twice in the backward (dQ and dK/dV kernels);
- T is padded to the chunk, K and V to powers of two >= 16 (Triton dots), with zero inputs and
  zero gates, which neither add to nor decay the state.
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels import pallas_launch as launch
from kernels.pallas_blocks import BlockSizes, col_of, doc_suffix_sum, dot, local_cumsum, supports  # noqa: F401 (supports: re-exported)
from kernels.x64 import fori_loop, iota

f32 = jnp.float32


BLOCK_SIZES = {
    # Not tuned (no GPU measurement yet). Per-channel gates: 16-token chunks keep the pairwise loop
    # short; 64 value columns give B * H * V / 64 programs. A scalar gate: 64-token chunks, all matmuls.
    "gpu": BlockSizes(block_t=16, block_v=64),
    "gpu-scalar": BlockSizes(block_t=64, block_v=64),
    "cpu": launch.INTERPRET_BLOCKS,
}


def default_block_sizes(backend: str | None = None, scalar_gate: bool = False) -> BlockSizes:
    backend = backend or jax.default_backend()
    if backend == "gpu" and scalar_gate:
        return BLOCK_SIZES["gpu-scalar"]
    return launch.block_sizes_for(BLOCK_SIZES, backend)


@dataclasses.dataclass(frozen=True)
class GLAOptions:
    """The static options of a GLA call that both kernel families (this file's and pallas_tpu.py's)
    read, beside their own blocks."""

    scale: float
    scalar: bool  # one log-decay per (token, head) rather than per channel
    segmented: bool
    length: int  # T before padding
    groups: int  # R = H / G value heads per query/key head


def gla_options(where: str, q, k, v, g, scale, segment_ids) -> GLAOptions:
    """The options of a call, after refusing inputs whose shapes do not agree (the wrappers' check)."""
    B, T, G, K = q.shape
    H = v.shape[2]
    launch.check_shapes(where, "q, k (B, T, G, K), v (B, T, H, V) with G dividing H and g (B, T, H[, K])",
                 H % G == 0 and k.shape == q.shape and g.shape[:3] == (B, T, H) and g.ndim in (3, 4),
                 q=q, k=k, v=v, g=g)
    return GLAOptions(scale=float(scale), scalar=g.ndim == 3, segmented=segment_ids is not None, length=T,
                      groups=H // G)


def gate_grad(q, k, dq, dk, dst, st, doc, prev, cfg, heads: int = 2):
    """dg (B, Tp, H[, K]) float32 by the state-free identity of the docstring, from q, k with G heads
    and dq, dk per value head on axis `heads` (2: (B, Tp, H, K); 1: (B, H, Tp, K)), the final state's
    cotangent dst and value st (B, H, V, K)."""
    R = cfg.groups
    dB = jnp.repeat(q, R, axis=heads).astype(f32) * dq - jnp.repeat(k, R, axis=heads).astype(f32) * dk
    dB = jnp.swapaxes(dB, 1, 2) if heads == 1 else dB  # (B, Tp, H, K)
    final = jnp.sum(dst * st, axis=2)  # (B, H, K): the final state's own e^{B_T} factor
    if cfg.scalar:
        dB, final = dB.sum(-1), final.sum(-1)
    return doc_suffix_sum(dB.at[:, cfg.length - 1].add(final), doc, prev)


def group_heads(x, R: int, heads: int = 2):
    """x per value head on axis `heads`, summed over the R value heads of each query/key head."""
    return x.reshape(*x.shape[:heads], -1, R, *x.shape[heads + 1:]).sum(heads + 1)


@dataclasses.dataclass(frozen=True)
class _Config(GLAOptions, launch.ChunkConfig):
    pass


def _load(n, q_ref, k_ref, b_ref, doc_ref, prev_ref, cfg):
    """Chunk n: q' (C, K), k (C, K) float32, the decays and masks of the docstring."""
    C = cfg.block_t
    t0 = pl.multiple_of(n * C, C)
    sl, last = pl.ds(t0, C), pl.ds(t0 + C - 1, 1)
    c = SimpleNamespace(t0=t0, sl=sl, q=q_ref[sl, :].astype(f32) * cfg.scale, k=k_ref[sl, :].astype(f32))
    if cfg.scalar:
        bv = b_ref[sl]  # (C,)
        c.b, b_last = bv[:, None], b_ref[last][None, :]  # (C, 1), (1, 1)
    else:
        c.b, b_last = b_ref[sl, :], b_ref[last, :]  # (C, K), (1, K)
    c.vis = iota((C, 1), 0) >= iota((1, C), 1)  # (C, C): key j visible from query i
    q_decay, k_decay, c.decay = jnp.exp(c.b), jnp.exp(b_last - c.b), jnp.exp(b_last)
    if cfg.segmented:
        c.doc = doc_ref[sl]  # (C,)
        state_doc, doc_last = jnp.min(prev_ref[sl]), jnp.max(c.doc)  # document of token t0 - 1
        c.vis = c.vis & (c.doc[:, None] == c.doc[None, :])
        q_decay = jnp.where((c.doc == state_doc)[:, None], q_decay, 0.0)
        k_decay = jnp.where((c.doc == doc_last)[:, None], k_decay, 0.0)
        c.decay = jnp.where(doc_last == state_doc, c.decay, 0.0)
    if cfg.scalar:  # pairwise decay e^{b_i - b_j}, zero where not visible; masked before exp
        c.E = jnp.where(c.vis, jnp.exp(jnp.where(c.vis, c.b - bv[None, :], 0.0)), 0.0)
    c.q_decay, c.k_decay = q_decay, k_decay
    c.qd, c.kd = c.q * q_decay, c.k * k_decay  # (C, K)
    return c


def _key(j, c, k_ref, b_ref, doc_ref, cfg):
    """Key j of the chunk (per-channel gates): k_j (1, K), E = e^{b_i - b_j} (C, K) with the
    exponent masked to 0 where key j is not visible (i < j: b_i - b_j > 0 could overflow), and
    which queries i see it (C, 1)."""
    row = pl.ds(c.t0 + j, 1)
    vis = iota((cfg.block_t, 1), 0) >= j
    if cfg.segmented:
        vis = vis & (c.doc == doc_ref[row])[:, None]
    E = jnp.exp(jnp.where(vis, c.b - b_ref[row, :], 0.0))
    return k_ref[row, :].astype(f32), E, vis


def _scores(c, k_ref, b_ref, doc_ref, cfg, dA=None):
    """The intra-chunk scores A (C, C), and with dA = dL/dA also dL/dk through A (C, K)."""
    C = cfg.block_t
    if cfg.scalar:
        A = dot(c.q, c.k, (1, 1), cfg) * c.E
        return A if dA is None else (A, dot(dA * c.E, c.q, (0, 0), cfg))

    def key(j, carry):
        A, dk = carry
        kj, E, vis = _key(j, c, k_ref, b_ref, doc_ref, cfg)
        a = jnp.where(vis, jnp.sum(c.q * kj * E, axis=1, keepdims=True), 0.0)  # (C, 1): column j
        A = A + jnp.where(iota((1, C), 1) == j, a, 0.0)
        if dA is not None:
            dkj = jnp.sum(jnp.where(vis, col_of(dA, j), 0.0) * c.q * E, axis=0, keepdims=True)  # (1, K)
            dk = dk + jnp.where(iota((C, 1), 0) == j, dkj, 0.0)
        return A, dk

    A, dk = fori_loop(0, C, key, (jnp.zeros((C, C), f32), jnp.zeros(c.k.shape, f32)))
    return A if dA is None else (A, dk)


def _fwd_kernel(q_ref, k_ref, v_ref, b_ref, doc_ref, prev_ref, s0_ref, o_ref, st_ref, *, cfg):
    def chunk(n, St):  # St (bv, K): the state, transposed
        c = _load(n, q_ref, k_ref, b_ref, doc_ref, prev_ref, cfg)
        v = v_ref[c.sl, :]  # (C, bv)
        A = _scores(c, k_ref, b_ref, doc_ref, cfg)
        o_ref[c.sl, :] = (dot(c.qd, St, (1, 1), cfg) + dot(A, v, (1, 0), cfg)).astype(o_ref.dtype)
        return St * c.decay + dot(v, c.kd, (0, 0), cfg)

    st_ref[...] = fori_loop(0, q_ref.shape[0] // cfg.block_t, chunk, s0_ref[...])


def _dq_kernel(q_ref, k_ref, v_ref, b_ref, doc_ref, prev_ref, s0_ref, do_ref, dq_ref, *, cfg):
    def chunk(n, St):
        c = _load(n, q_ref, k_ref, b_ref, doc_ref, prev_ref, cfg)
        v, do = v_ref[c.sl, :], do_ref[c.sl, :]
        dA = dot(do, v, (1, 1), cfg)  # (C, C)
        dq = dot(do, St, (1, 0), cfg) * c.q_decay  # (C, K), w.r.t. q'
        if cfg.scalar:
            dq = dq + dot(dA * c.E, c.k, (1, 0), cfg)
        else:
            def key(j, dq):
                kj, E, vis = _key(j, c, k_ref, b_ref, doc_ref, cfg)
                return dq + jnp.where(vis, col_of(dA, j), 0.0) * kj * E
            dq = fori_loop(0, cfg.block_t, key, dq)
        dq_ref[c.sl, :] = dq * cfg.scale
        return St * c.decay + dot(v, c.kd, (0, 0), cfg)

    fori_loop(0, q_ref.shape[0] // cfg.block_t, chunk, s0_ref[...])


def _dkv_kernel(q_ref, k_ref, v_ref, b_ref, doc_ref, prev_ref, do_ref, dst_ref, dk_ref, dv_ref, ds0_ref,
                *, cfg):
    num_chunks = q_ref.shape[0] // cfg.block_t

    def chunk(i, dSt):  # dSt (bv, K): dL/dS_[n], transposed
        c = _load(num_chunks - 1 - i, q_ref, k_ref, b_ref, doc_ref, prev_ref, cfg)
        v, do = v_ref[c.sl, :], do_ref[c.sl, :]
        A, dk = _scores(c, k_ref, b_ref, doc_ref, cfg, dA=dot(do, v, (1, 1), cfg))
        dk_ref[c.sl, :] = dk + dot(v, dSt, (1, 0), cfg) * c.k_decay
        dv_ref[c.sl, :] = (dot(c.kd, dSt, (1, 1), cfg) + dot(A, do, (0, 0), cfg)).astype(dv_ref.dtype)
        return dSt * c.decay + dot(do, c.qd, (0, 0), cfg)

    ds0_ref[...] = fori_loop(0, num_chunks, chunk, dst_ref[...])


def _specs(cfg, q, v):
    """BlockSpecs over the grid (value block, batch row, head) for q/k, v, b, rows and states."""
    Tp, K, bv, R = q.shape[1], q.shape[3], cfg.block_v, cfg.groups
    qk = pl.BlockSpec((None, Tp, None, K), lambda j, b, h: (b, 0, h // R, 0))
    vs = pl.BlockSpec((None, Tp, None, bv), lambda j, b, h: (b, 0, h, j))
    bs = (pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0)) if cfg.scalar
          else pl.BlockSpec((None, Tp, None, K), lambda j, b, h: (b, 0, h, 0)))
    row = pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0))
    st = pl.BlockSpec((None, None, bv, K), lambda j, b, h: (b, h, j, 0))
    part = pl.BlockSpec((None, None, Tp, None, K), lambda j, b, h: (j, b, 0, h, 0))  # per value block
    return SimpleNamespace(qk=qk, v=vs, b=bs, row=row, st=st, part=part,
                           grid=(v.shape[3] // bv, q.shape[0], v.shape[2]))


def _call(kernel, cfg, s, *specs_shapes_name_args):
    return launch.triton_call(functools.partial(kernel, cfg=cfg), cfg, s.grid, *specs_shapes_name_args)


def _forward(q, k, v, b, doc, prev, s0t, cfg):
    s = _specs(cfg, q, v)
    return _call(_fwd_kernel, cfg, s, [s.qk, s.qk, s.v, s.b, s.row, s.row, s.st], [s.v, s.st],
                 [jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(s0t.shape, f32)],
                 "gla_fwd", q, k, v, b, doc, prev, s0t)


def _gate_cumsum(g, cfg):
    """b: the log-decays summed from each chunk's start, float32; (B, H, Tp) for a scalar gate."""
    b = local_cumsum(g, cfg.block_t)
    return jnp.swapaxes(b, 1, 2) if cfg.scalar else b


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _gla(q, k, v, g, doc, prev, s0t, cfg):
    return _forward(q, k, v, _gate_cumsum(g, cfg), doc, prev, s0t, cfg)


def _gla_fwd(q, k, v, g, doc, prev, s0t, cfg):
    b = _gate_cumsum(g, cfg)
    o, st = _forward(q, k, v, b, doc, prev, s0t, cfg)
    return (o, st), (q, k, v, g, b, doc, prev, s0t, st)


def _gla_bwd(cfg, res, cts):
    q, k, v, g, b, doc, prev, s0t, st = res
    do, dst = cts
    do = do.astype(q.dtype)
    s = _specs(cfg, q, v)
    part = jax.ShapeDtypeStruct((s.grid[0], *v.shape[:3], q.shape[3]), f32)
    dq = _call(_dq_kernel, cfg, s, [s.qk, s.qk, s.v, s.b, s.row, s.row, s.st, s.v], s.part, part,
               "gla_dq", q, k, v, b, doc, prev, s0t, do)
    dk, dv, ds0t = _call(_dkv_kernel, cfg, s, [s.qk, s.qk, s.v, s.b, s.row, s.row, s.v, s.st],
                         [s.part, s.v, s.st],
                         [part, jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(s0t.shape, f32)],
                         "gla_dkv", q, k, v, b, doc, prev, do, dst)
    dq, dk = dq.sum(0), dk.sum(0)  # (B, Tp, H, K), per value head
    dg = gate_grad(q, k, dq, dk, dst, st, doc, prev, cfg)
    group = lambda x: group_heads(x, cfg.groups)  # (B, Tp, G, K)
    return (group(dq).astype(q.dtype), group(dk).astype(k.dtype), dv, dg.astype(g.dtype), None, None, ds0t)


_gla.defvjp(_gla_fwd, _gla_bwd)


def gla_pallas(q: Float[Array, "B T G K"], k: Float[Array, "B T G K"], v: Float[Array, "B T H V"],
               g: Float[Array, "B T H K"] | Float[Array, "B T H"], *, scale: float = 1.0,
               segment_ids: Int[Array, "B T"] | None = None,
               initial_state: Float[Array, "B H K V"] | None = None,
               block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Same function as gla_reference, differentiable in q, k, v, g and initial_state. Returns
    (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32).

    g (B, T, H, K): one log-decay per channel; g (B, T, H): one per head (scalar gate). q and k may
    have G heads with G dividing H. interpret=None: interpret mode everywhere but on GPU.
    """
    B, T, G, K = q.shape
    H, V = v.shape[2:]
    opts = gla_options("gla_pallas", q, k, v, g, scale, segment_ids)
    sizes, Tp, Kp, Vp = launch.chunk_launch(block_sizes or default_block_sizes(scalar_gate=opts.scalar), T, K, V,
                                      q.dtype, interpret)
    cfg = _Config(**dataclasses.asdict(opts), **sizes)
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, d - x.shape[3])))
    g = jnp.pad(g, ((0, 0), (0, Tp - T), (0, 0))) if opts.scalar else pad(g, Kp)
    doc, prev = launch.document_rows(segment_ids, B, T, Tp)  # (B, Tp) each: zeros without segment_ids
    s0t = launch.padded_state(initial_state, B, H, Kp, Vp, transpose=True)  # (B, H, Vp, Kp)
    o, st = _gla(pad(q, Kp), pad(k, Kp), pad(v, Vp), g, doc, prev, s0t, cfg)
    return o[:, :T, :, :V], jnp.swapaxes(st, 2, 3)[:, :, :K, :V]
