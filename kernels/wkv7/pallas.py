"""WKV7 (RWKV-7's generalised delta rule, Peng et al., 2025, arXiv:2503.14456) in Pallas, forward and
backward, fused over chunks: one program per (value block, batch row, head) walks the sequence chunk
by chunk with the state on chip, as kernels/delta_rule/pallas.py does for the delta rule.

The recurrence (reference.py, (K, V) state): S_t = diag(w_t) S_{t-1} + b_t sa_t + k_t v_t^T with
sa_t = a_t^T S_{t-1}, o_t = S_t^T r_t. Per chunk of C tokens entering with state S, with G_i =
sum of log w over the chunk up to token i (inclusive), G-_i the same up to i - 1 (exclusive) and
L = C - 1 (chunk.py derives it):

    A^rk_ij = sum_c r_ic k_jc e^{G_ic - G_jc} [j <= i]     A^rb: the same with b_j
    A^ak_ij = sum_c a_ic k_jc e^{G-_ic - G_jc} [j < i]     A^ab: the same with b_j
    M = (I - A^ab)^{-1},  W = M (a ⊙ e^{G-}),  U~ = M A^ak V            (the UT transform)
    SA = W S + U~                                         (rows sa_i; the state-dependent "values")
    O = (r ⊙ e^{G}) S + A^rk V + A^rb SA
    S_next = diag(e^{G_L}) S + (k ⊙ e^{G_L - G})^T V + (b ⊙ e^{G_L - G})^T SA

Backward, reverse over chunks carrying dS = dL/dS_next (dS_T: the final state's cotangent):

    dSA = A^rb^T dO + (b ⊙ e^{G_L - G}) dS      dX = M^T dSA      dW = dSA S^T      da~ = M^T dW
    dA^rk = dO V^T,  dA^rb = dO SA^T,  dA^ak = dX V^T,  dA^ab = dX U~^T + da~ W^T   (masked like A)
    dV = A^rk^T dO + A^ak^T dX + (k ⊙ e^{G_L - G}) dS
    dS_prev = diag(e^{G_L}) dS + (r ⊙ e^{G})^T dO + W^T dSA              (dS_-1: d initial_state)

then dr, da, dk, db by the chain rule through the scores (a loop over the chunk's keys j:
dr_i += (dA^rk_ij k_j + dA^rb_ij b_j) ⊙ e^{G_i - G_j}, dk_j += sum_i dA^rk_ij r_i ⊙ e^{G_i - G_j} +
dA^ak_ij a_i ⊙ e^{G-_i - G_j}, ...) and through the decayed terms (dr += dO S^T ⊙ e^{G},
da += da~ ⊙ e^{G-}, dk += V dS^T ⊙ e^{G_L - G}, db += SA dS^T ⊙ e^{G_L - G}). Every decay enters as
x_i ⊙ e^{G_i} or y_j ⊙ e^{-G_j}, so dL/dG_i = x_i ⊙ dx_i - y_i ⊙ dy_i (+ diag(dS S^T) ⊙ e^{G_L}
and the e^{G_L - G} pairs at row L), likewise dL/dG-_i = a_i ⊙ da_i (through M, W and A^a*), and
d log w_t = sum_{i >= t} dL/dG_i + sum_{i > t} dL/dG-_i over t's chunk and document (the transpose
of the chunk-local cumsums; later documents add exactly zero), 0 at a document start, where the
decay multiplies a zero state.

Memory: the backward needs each chunk's start state; running the recurrence backwards would invert
diag(w) + b a^T (singular in general), so a third kernel recomputes the states forward in the
backward pass and writes them to HBM: (T / C) * K * V float32 per (batch row, head), alive only
during the backward (fla recomputes h the same way). The residuals kept from forward to backward
are the inputs and the chunk-local cumulative decays G, G- (2 x (B, T, H, K) float32); scores, M,
W, U~ are recomputed per chunk.

Code names -> paper symbols (the paper's (V, K) state transposed, see reference.py): r -> r_t,
w_log -> log w_t, k -> k~_t, v -> v_t, a -> -kappa^_t, b -> kappa^_t * a_t; `St` = S^T (V, K), kept
transposed so that a per-channel decay is a row that broadcasts (as in kernels/gla/pallas.py);
`Gm` = G-, `Ark`, `Arb`, `Aak`, `Aab` = A^rk, A^rb, A^ak, A^ab; `N` = M^T (built by the delta rule's
forward substitution); `Ut` = U~; `ri` = r ⊙ e^{G}, `ai` = a ⊙ e^{G-} (the reads of S), `ko`, `bo` =
k, b ⊙ e^{G_L - G} (the writes of S_next), `gamma` = e^{G_L} (the decay of S across the chunk).

Documents: doc(t) counts the document starts up to t; the scores also need doc(i) == doc(j); the
incoming state is read only by tokens of the document of the token before the chunk, survives the
chunk only if no document starts in it, and only the chunk's last document writes S_next.
Stability: every exponent is <= 0 (G_L - G, G, G-) or masked to 0 before exp where it is not
(e^{G_i - G_j} for j > i): nothing overflows for any decay.

Backend. On GPU the kernels are lowered through Triton (pltriton.CompilerParams), for the reason
kernels/attention/pallas.py and kernels/gla/pallas.py give: this plain-jnp grid + BlockSpec kernel
does not lower to Mosaic GPU in jax 0.10.2 (no dot_general rule there), runs unchanged in interpret
mode where the tests check it, and lets Triton pick the tensor-core instructions. Without a GPU,
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` checks that the three kernels lower to
Triton IR; that Triton compiles and runs them is checked only by the test marked gpu. The TPU
kernel is kernels/wkv7/pallas_tpu.py.

Departures from fla's chunk_dplr_delta_rule:
- one kernel per direction walks all chunks (fla: separate kernels for the intra-chunk scores, the
  WY representation, the states h, the output, and five for the backward, with A^*, w, u, h, v_new
  written to HBM);
- one level of 16-token chunks; the scores loop over the chunk's keys with the exponent masked
  before exp (fla: 64-token chunks of 16-token sub-chunks, exponentials relative to a sub-chunk
  reference point, solve_tril merging 16 x 16 inverses);
- M by forward substitution over the whole C x C tile (`unit_lower_inverse_t` of kernels/pallas_blocks.py);
- dr, dk, da, db and d log w of each value block are partial sums, added over the value blocks in
  XLA; the chunk-local cumulative decays are computed in XLA (as fla's chunk_local_cumsum), the
  suffix sums of the decay gradient inside the kernel (fla: a reverse cumsum kernel);
- T is padded to the chunk, K and V to powers of two >= 16 (Triton dots), with zero inputs and
  log-decays, which neither write nor decay the state; every dot casts its operands to the inputs'
  dtype (bfloat16 inputs: M, W and the state enter the tensor cores in bfloat16, accumulating in
  float32).
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

# The delta-rule kernels' triangular inverse; the GLA kernels' block knobs, dot and column helpers,
# launch and auto-dispatch rule.
from kernels import pallas_launch as launch
from kernels.pallas_blocks import EXACT, BlockSizes, col_of, dot, local_cumsum, supports, unit_lower_inverse_t  # noqa: F401 (supports: re-exported)
from kernels.x64 import fori_loop, iota

f32 = jnp.float32

# Not tuned (no GPU measurement yet): 16-token chunks keep the per-key loops and the C-step
# substitution short (the official RWKV-7 CUDA kernel also uses 16); 64 value columns.
default_block_sizes = launch.block_defaults(gpu=BlockSizes(block_t=16, block_v=64))


@dataclasses.dataclass(frozen=True)
class _Config(launch.ChunkConfig):
    w_dtype: str  # w_log's dtype (of its cotangent)


def _key(j, c, refs):
    """Key j of the chunk: k_j, b_j (1, K); e^{G_i - G_j} and e^{G-_i - G_j} (C, K), exponents
    masked to 0 where key j is not seen (they could be > 0); which queries see it (C, 1)."""
    k_ref, b_ref, G_ref, doc_ref = refs.k, refs.b, refs.G, refs.doc
    row = pl.ds(c.t0 + j, 1)
    i = iota((c.r.shape[0], 1), 0)
    incl = (i >= j) & (c.doc == doc_ref[row])[:, None]
    strict = incl & (i != j)
    Gj = G_ref[row, :]
    E1 = jnp.exp(jnp.where(incl, c.G - Gj, 0.0))
    E2 = jnp.exp(jnp.where(strict, c.Gm - Gj, 0.0))
    return k_ref[row, :].astype(f32), b_ref[row, :].astype(f32), E1, E2, incl, strict


def _scores(c, refs):
    """A^rk, A^rb, A^ak, A^ab (C, C), built one key (column) at a time."""
    C = c.r.shape[0]

    def key(j, As):
        kj, bj, E1, E2, incl, strict = _key(j, c, refs)
        rE, aE = c.r * E1, c.a * E2
        cols = (jnp.where(incl, jnp.sum(rE * kj, axis=1, keepdims=True), 0.0),
                jnp.where(incl, jnp.sum(rE * bj, axis=1, keepdims=True), 0.0),
                jnp.where(strict, jnp.sum(aE * kj, axis=1, keepdims=True), 0.0),
                jnp.where(strict, jnp.sum(aE * bj, axis=1, keepdims=True), 0.0))
        at_j = iota((1, C), 1) == j
        return tuple(A + jnp.where(at_j, col, 0.0) for A, col in zip(As, cols))

    return fori_loop(0, C, key, (jnp.zeros((C, C), f32),) * 4)


def _score_grads(c, refs, dArk, dArb, dAak, dAab):
    """dL/dr, dL/da, dL/dk, dL/db (C, K) through the scores, given dL/dA^* (C, C)."""
    C = c.r.shape[0]

    def key(j, acc):
        dr, da, dk, db = acc
        kj, bj, E1, E2, incl, strict = _key(j, c, refs)
        crk, crb = (jnp.where(incl, col_of(d, j), 0.0) for d in (dArk, dArb))  # (C, 1)
        cak, cab = (jnp.where(strict, col_of(d, j), 0.0) for d in (dAak, dAab))
        rE, aE = c.r * E1, c.a * E2
        dr = dr + (crk * kj + crb * bj) * E1
        da = da + (cak * kj + cab * bj) * E2
        at_j = iota((C, 1), 0) == j
        dk = dk + jnp.where(at_j, jnp.sum(crk * rE + cak * aE, axis=0, keepdims=True), 0.0)
        db = db + jnp.where(at_j, jnp.sum(crb * rE + cab * aE, axis=0, keepdims=True), 0.0)
        return dr, da, dk, db

    return fori_loop(0, C, key, (jnp.zeros(c.r.shape, f32),) * 4)


def _chunk(n, refs, cfg):
    """Chunk n's inputs and the state-independent terms of the docstring (all float32)."""
    C = cfg.block_t
    t0 = pl.multiple_of(n * C, C)
    sl = pl.ds(t0, C)
    c = SimpleNamespace(t0=t0, sl=sl, r=refs.r[sl, :].astype(f32), k=refs.k[sl, :].astype(f32),
                        a=refs.a[sl, :].astype(f32), b=refs.b[sl, :].astype(f32), v=refs.v[sl, :].astype(f32),
                        G=refs.G[sl, :], Gm=refs.Gm[sl, :], doc=refs.doc[sl])
    state_doc, doc_last = jnp.min(refs.prev[sl]), jnp.max(c.doc)  # documents of tokens t0 - 1, t0 + C - 1
    G_last = refs.G[pl.ds(t0 + C - 1, 1), :]  # (1, K)
    reads = (c.doc == state_doc)[:, None]  # (C, 1): token reads the incoming state
    writes = (c.doc == doc_last)[:, None]  # (C, 1): token writes S_next
    c.start = (c.doc != refs.prev[sl])[:, None]  # (C, 1): a document starts here
    c.vis = (iota((C, C), 0) >= iota((C, C), 1)) & (c.doc[:, None] == c.doc[None, :])  # key j seen by i
    c.strict = c.vis & (iota((C, C), 0) != iota((C, C), 1))
    c.rdec = jnp.where(reads, jnp.exp(c.G), 0.0)  # (C, K)
    c.adec = jnp.where(reads, jnp.exp(c.Gm), 0.0)
    c.ri, c.ai = c.r * c.rdec, c.a * c.adec
    tail = jnp.where(writes, jnp.exp(G_last - c.G), 0.0)  # G_L - G <= 0
    c.tail, c.ko, c.bo = tail, c.k * tail, c.b * tail
    c.gamma = jnp.where(doc_last == state_doc, jnp.exp(G_last), 0.0)  # (1, K)
    c.Ark, c.Arb, c.Aak, c.Aab = _scores(c, refs)
    c.N = unit_lower_inverse_t(-c.Aab)  # M^T
    c.W = dot(c.N, c.ai, (0, 0), cfg)  # (C, K): M (a ⊙ e^{G-})
    c.Ut = dot(c.N, dot(c.Aak, c.v, (1, 0), cfg), (0, 0), cfg)  # (C, bv): M A^ak V
    return c


_IN = ("r", "k", "v", "a", "b", "G", "Gm", "doc", "prev")


def _fwd_kernel(*refs, cfg, states):
    """With states=False writes o (Tp, bv); with states=True the transposed state entering each
    chunk (N*bv, K) instead. Both write the final state (transposed)."""
    ins = SimpleNamespace(**dict(zip(_IN, refs)))
    s0_ref, out_ref, st_ref = refs[len(_IN):]
    bv = cfg.block_v

    def chunk(n, St):  # St (bv, K): the state entering chunk n, transposed
        c = _chunk(n, ins, cfg)
        SA = dot(c.W, St, (1, 1), cfg) + c.Ut  # (C, bv)
        if states:
            out_ref[pl.ds(pl.multiple_of(n * bv, bv), bv), :] = St
        else:
            o = dot(c.ri, St, (1, 1), cfg) + dot(c.Ark, c.v, (1, 0), cfg) + dot(c.Arb, SA, (1, 0), cfg)
            out_ref[c.sl, :] = o.astype(out_ref.dtype)
        return St * c.gamma + dot(c.v, c.ko, (0, 0), cfg) + dot(SA, c.bo, (0, 0), cfg)

    st_ref[...] = fori_loop(0, ins.r.shape[0] // cfg.block_t, chunk, s0_ref[...])


def _bwd_kernel(*refs, cfg):
    ins = SimpleNamespace(**dict(zip(_IN, refs)))
    h_ref, do_ref, dst_ref, dr_ref, dk_ref, dv_ref, da_ref, db_ref, dw_ref, ds0_ref = refs[len(_IN):]
    C, bv = cfg.block_t, cfg.block_v
    num_chunks = ins.r.shape[0] // C

    def chunk(i, dSt):  # dSt (bv, K): dL/dS at the end of chunk n, transposed
        n = num_chunks - 1 - i
        c = _chunk(n, ins, cfg)
        St = h_ref[pl.ds(pl.multiple_of(n * bv, bv), bv), :]  # (bv, K): the state entering chunk n
        do = do_ref[c.sl, :].astype(f32)  # (C, bv)
        SA = dot(c.W, St, (1, 1), cfg) + c.Ut
        dSA = dot(c.Arb, do, (0, 0), cfg) + dot(c.bo, dSt, (1, 1), cfg)  # (C, bv)
        dX = dot(c.N, dSA, (1, 0), cfg)  # M^T dSA
        dW = dot(dSA, St, (1, 0), cfg)  # (C, K)
        dai = dot(c.N, dW, (1, 0), cfg)  # M^T dW
        dr, da, dk, db = _score_grads(
            c, ins, dot(do, c.v, (1, 1), cfg), dot(do, SA, (1, 1), cfg), dot(dX, c.v, (1, 1), cfg),
            dot(dX, c.Ut, (1, 1), cfg) + dot(dai, c.W, (1, 1), cfg))
        dri = dot(do, St, (1, 0), cfg)  # (C, K): dL/d(r ⊙ e^{G})
        dko, dbo = dot(c.v, dSt, (1, 0), cfg), dot(SA, dSt, (1, 0), cfg)  # dL/d(k, b ⊙ e^{G_L - G})
        dr_ref[c.sl, :] = dr + dri * c.rdec
        da_ref[c.sl, :] = da + dai * c.adec
        dk_ref[c.sl, :] = dk + dko * c.tail
        db_ref[c.sl, :] = db + dbo * c.tail
        dv_ref[c.sl, :] = (dot(c.Ark, do, (0, 0), cfg) + dot(c.Aak, dX, (0, 0), cfg)
                           + dot(c.ko, dSt, (1, 1), cfg)).astype(dv_ref.dtype)
        out = c.ko * dko + c.bo * dbo  # (C, K): through e^{G_L - G_j}
        to_last = jnp.sum(out, axis=0, keepdims=True) + c.gamma * jnp.sum(dSt * St, axis=0, keepdims=True)
        dG = (c.r * dr + c.ri * dri - c.k * dk - c.b * db - out
              + jnp.where(iota((C, 1), 0) == C - 1, to_last, 0.0))  # (C, K): dL/dG
        dGm = c.a * da + c.ai * dai  # dL/dG-
        # d log w_t: sum over i >= t (G) and i > t (G-) in t's chunk and document.
        dw = dot(c.vis.astype(f32), dG, (0, 0), EXACT) + dot(c.strict.astype(f32), dGm, (0, 0), EXACT)
        dw_ref[c.sl, :] = jnp.where(c.start, 0.0, dw)
        return dSt * c.gamma + dot(do, c.ri, (0, 0), cfg) + dot(dSA, c.W, (0, 0), cfg)

    ds0_ref[...] = fori_loop(0, num_chunks, chunk, dst_ref[...])


def _specs(cfg, r, v):
    """BlockSpecs over the grid (value block, batch row, head)."""
    Tp, H, K = r.shape[1:]
    bv = cfg.block_v
    num_chunks = Tp // cfg.block_t
    return SimpleNamespace(
        grid=(v.shape[3] // bv, r.shape[0], H),
        k=pl.BlockSpec((None, Tp, None, K), lambda j, b, h: (b, 0, h, 0)),  # r, k, a, b, G, G-
        v=pl.BlockSpec((None, Tp, None, bv), lambda j, b, h: (b, 0, h, j)),
        row=pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),  # doc, prev: (B, Tp)
        st=pl.BlockSpec((None, None, bv, K), lambda j, b, h: (b, h, j, 0)),  # S^T (B, H, Vp, Kp)
        h=pl.BlockSpec((None, None, None, num_chunks * bv, K), lambda j, b, h: (b, h, j, 0, 0)),
        part=pl.BlockSpec((None, None, Tp, None, K), lambda j, b, h: (j, b, 0, h, 0)))


def _forward(cfg, *ins, states=False):
    """(o, or the per-chunk start states (B, H, Vp / bv, N*bv, Kp), final state transposed). ins: the
    inputs of _IN, then s0t."""
    ins, s0t = ins[:-1], ins[-1]
    r, v = ins[0], ins[2]
    s = _specs(cfg, r, v)
    B, Tp, H, K = r.shape
    nvb, bv = v.shape[3] // cfg.block_v, cfg.block_v
    out = ((s.h, jax.ShapeDtypeStruct((B, H, nvb, Tp // cfg.block_t * bv, K), f32)) if states
           else (s.v, jax.ShapeDtypeStruct(v.shape, r.dtype)))
    return launch.triton_call(functools.partial(_fwd_kernel, cfg=cfg, states=states), cfg, s.grid,
                       [s.k, s.k, s.v, s.k, s.k, s.k, s.k, s.row, s.row, s.st], [out[0], s.st],
                       [out[1], jax.ShapeDtypeStruct(s0t.shape, f32)],
                       "wkv7_states" if states else "wkv7_fwd", *ins, s0t)


def _prepare(cfg, r, w_log, k, v, a, b, doc, prev, s0t):
    """The kernels' inputs (_IN, then s0t), with G, G-: the log-decays summed from each chunk's start,
    inclusive and exclusive, float32."""
    G = local_cumsum(w_log, cfg.block_t)  # (B, Tp, H, K)
    return r, k, v, a, b, G, G - w_log.astype(f32), doc, prev, s0t


def _backward(cfg, res, cts):
    ins, s0t = res[:-1], res[-1]
    r, k, v, a, b = ins[:5]
    do, dst = cts
    h, _ = _forward(cfg, *res, states=True)
    s = _specs(cfg, r, v)
    part = jax.ShapeDtypeStruct((s.grid[0], *r.shape), f32)
    dr, dk, dv, da, db, dw, ds0t = launch.triton_call(
        functools.partial(_bwd_kernel, cfg=cfg), cfg, s.grid,
        [s.k, s.k, s.v, s.k, s.k, s.k, s.k, s.row, s.row, s.h, s.v, s.st],
        [s.part, s.part, s.v, s.part, s.part, s.part, s.st],
        [part, part, jax.ShapeDtypeStruct(v.shape, v.dtype), part, part, part, jax.ShapeDtypeStruct(s0t.shape, f32)],
        "wkv7_bwd", *ins, h, do.astype(r.dtype), dst)
    total = lambda x, like: x.sum(0).astype(like)  # partial sums over the value blocks
    return (total(dr, r.dtype), total(dw, cfg.w_dtype), total(dk, k.dtype), dv, total(da, a.dtype),
            total(db, b.dtype), None, None, ds0t)


_wkv7 = launch.recompute_vjp(_prepare, _forward, _backward)


def check_wkv7_shapes(where: str, r, w_log, k, v, a, b):
    """Refuse inputs whose shapes do not agree (the Pallas wrappers' check)."""
    launch.check_shapes(where, "r, w_log, k, a, b (B, T, H, K) and v (B, T, H, V)",
                 all(x.shape == r.shape for x in (w_log, k, a, b)) and v.shape[:3] == r.shape[:3],
                 r=r, w_log=w_log, k=k, v=v, a=a, b=b)


def wkv7_pallas(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
                segment_ids: Int[Array, "B T"] | None = None,
                initial_state: Float[Array, "B H K V"] | None = None,
                block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Same function as wkv7_recurrent, differentiable in r, w_log, k, v, a, b and initial_state.
    Returns (o (B, T, H, V) in r's dtype, final state (B, H, K, V) float32). interpret=None:
    interpret mode everywhere but on GPU."""
    B, T, H, K = r.shape
    V = v.shape[3]
    check_wkv7_shapes("wkv7_pallas", r, w_log, k, v, a, b)
    sizes, Tp, Kp, Vp = launch.chunk_launch(block_sizes or default_block_sizes(), T, K, V, r.dtype, interpret)
    cfg = _Config(**sizes, w_dtype=jnp.dtype(w_log.dtype).name)
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, d - x.shape[3])))  # (B, Tp, H, d)
    doc, prev = launch.document_rows(segment_ids, B, T, Tp)  # (B, Tp) each
    s0t = launch.padded_state(initial_state, B, H, Kp, Vp, transpose=True)  # (B, H, Vp, Kp)
    o, st = _wkv7(cfg, pad(r, Kp), pad(w_log, Kp), pad(k, Kp), pad(v, Vp), pad(a, Kp), pad(b, Kp), doc, prev, s0t)
    return o[:, :T, :, :V], jnp.swapaxes(st, 2, 3)[:, :, :K, :V]
