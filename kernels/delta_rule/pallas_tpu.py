"""The (gated) delta rule as Pallas TPU kernels (Mosaic): DeltaNet (Yang et al., 2024,
arXiv:2406.06484, sec. 3, the chunkwise WY/UT form), Gated DeltaNet (Yang, Kautz & Hatamizadeh,
2024, arXiv:2412.06464, sec. 3.3) and Kimi Delta Attention (Kimi Team, 2025, "Kimi Linear"; a gate
per key channel). The same function, equations and custom_vjp as the GPU kernels
in kernels/delta_rule/pallas.py (read its docstring for the forward and backward equations and the
document rules); this file lays them out for the TPU.

Per chunk of C tokens entering with state S (q' = scale q, G the chunk-local cumulative gate,
D_ij = e^{G_i - G_j} for j <= i in the same document):

    A = strict_tril(diag(beta) (K K^T ⊙ D))       M = (I + A)^{-1}      (unit lower-triangular)
    W = M diag(beta Gamma) K,   U~ = M diag(beta) V,   U = U~ - W S           (the UT transform)
    O = diag(Gamma) Q' S + (Q' K^T ⊙ D) U,         S_next = Gamma_{C-1} S + (diag(D_{C-1,:}) K)^T U

Per key channel (KDA, g (B, T, H, K)), G_i in R^K and the decays move inside the products over k:

    A_ij = beta_i sum_k k_ik k_jk e^{G_ik - G_jk} (j < i, same document)
         = strict_tril(diag(beta) ((K ⊙ e^{G}) (K ⊙ e^{-G})^T)) masked, never computed that way
    W = M diag(beta) (c ⊙ e^{G} ⊙ K),   O = (c ⊙ e^{G} ⊙ Q') S + P U,   P_ij = sum_k q'_ik k_jk e^{G_ik - G_jk}
    S_next = diag(e^{G_{C-1}}) S + (K ⊙ e^{G_{C-1} - G})^T U

e^{-G} overflows float32 once a channel has decayed past e^-88 inside a chunk (4.4 tokens of gate
-20; the chunk here is 64): P and the decayed K K^T come from kernels/delta_rule/pairwise.py, a
loop over the chunk's C keys that forms e^{G_i - G_j} for all queries as a (C, K) tile with the
exponent masked to 0 before exp where i < j, so every exponent in the kernels is <= 0 and nothing
overflows for any gate <= 0; the backward's per-channel dG and dg are pallas.py's (its docstring),
written as a (C, K) block of a (B, H, Tp, K) output. The cumulative gates G come in as a
(B, H, Tp, K) float32 input with q's BlockSpec (the G row of the per-token scalars is then zero).

Grid (B, H, N chunks): batch rows and heads "parallel", chunks last and "arbitrary" (sequential).
BlockSpecs bring one chunk of q, k (C, K), v (C, V) and the per-token scalars (6, C) into VMEM
per step; the (K, V) float32 state lives in a VMEM scratch buffer carried across the chunk steps
(set from initial_state at chunk 0, written out as the final state at chunk N - 1). Whole K and V
per program (no value blocks: a 128 x 256 float32 state is 128 KiB, and without value blocks dq, dk,
dbeta and dg are whole sums, not partial sums added in XLA).

The inverse M on chip: by blocks that double in size, as kernels/linalg.py and fla's solve_tril
merge theirs. With M_b the block-diagonal inverse of the b x b diagonal blocks (M_1 = I),

    M_2b = M_b - M_b (A ⊙ mask_b) M_b,    mask_b: the lower-left b x b block of each 2b x 2b block

(the inverse of [[I + A11, 0], [A21, I + A22]] has lower-left block -M22 A21 M11): log2 C steps of
two C x C matmuls, float32 at HIGHEST precision, on the MXU. Chosen over forward substitution (C
sequential steps of vector work and cross-lane reductions, the GPU kernel's way) because the MXU
does the matmuls, and over the series (I - L)^{-1} = prod_i (I + L^{2^i}) (L = -A) because the
series sums powers of L whose entries grow like binomial coefficients when keys in a chunk are
alike (beta = 1, equal keys: entries up to C(62, 31) ~ 5e17 for C = 64) and cancel to an inverse
of entries +-1, which float32 cannot do. Every term of the block form is a product of blocks of
the true inverse.

Backward: a reverse-time kernel on the same grid (index maps n -> N - 1 - n) carries dS = dL/dS
in a VMEM scratch (set from the final state's cotangent, written out as d initial_state). It
needs each chunk's start state: running the delta rule backwards would invert I - beta k k^T
(singular at beta = 1), so the backward first reruns the forward kernel in a mode that writes the
state entering each chunk to HBM, (B, H, N, K, V) float32 = (T / C) * K * V * 4 bytes per (row,
head) (4 MiB at T = 4096, C = 64, K = V = 128), alive only during the backward, as in the GPU
kernel and fla's chunk_gated_delta_rule_bwd. The residuals kept from forward to backward are the
inputs only; M, W and U~ are recomputed per chunk.

Code names as in pallas.py: `cg` = c ⊙ Gamma (c_i: token i sees the incoming state), `kd` =
D_{C-1,:} masked to the chunk's last document, `gamma` = the decay of S across the chunk, `E` = D
masked to the chunk's documents, `Ut` = U~, `dVb`, `dKb` = M^T dU, M^T dW; `P`, `KK` the decayed
Q' K^T and K K^T (masked), `cfg.channel` a per-channel gate, then `cg`, `kd` (C, K) and `gamma` a
(K, 1) column.

Backend: Mosaic TPU, the only Pallas backend for TPUs. `interpret=None` runs the TPU interpreter
(pltpu.InterpretParams) everywhere but on a TPU, which is how the tests check it on CPU; without a
TPU, `jax.jit(...).trace(...).lower(lowering_platforms=("tpu",))` checks that the kernels lower
to Mosaic (tpu_custom_call); they have not yet run on a TPU.

Departures from the GPU kernel (and so from fla, beyond those listed there):
- one chunk per grid step with the state in scratch, not one program looping over all chunks;
- the document masks c (token in the incoming state's document), "in the chunk's last document"
  and "a document starts here" are computed in XLA in the wrapper and passed with beta, G and the
  document index as one (B, H, N, 6, C) float32 array of per-token scalars, rows per chunk (a
  (C, 6) block would pad to a (C, 128) tile in HBM and VMEM, more bytes than q in bfloat16);
- M by the block-doubling matmuls above, not by forward substitution; M itself (not M^T) is built,
  and tiles are transposed explicitly where a product needs M^T, P^T or K^T;
- K and V are not padded (the blocks span the whole head dims); only T is padded, to the chunk,
  with zero inputs, beta and gates, which neither write nor decay the state;
- dots cast their operands to the inputs' dtype (bfloat16 inputs: bfloat16 MXU passes, float32
  accumulation), except the inverse's and dg's 0/1 suffix sum, which stay float32 at HIGHEST;
- per-channel gates: the pairwise decays by the loop over all C = 64 keys on the VPU, with keys
  and columns picked by masks and reductions (GLA's TPU kernel instead uses 16-token sub-chunks,
  matmuls through a reference point between them and 0/1 gather matmuls; not measured here).
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels import pallas_launch as launch
from kernels.delta_rule.pairwise import pair_grads, pair_scores
from kernels.delta_rule.pallas import check_delta_rule_shapes
from kernels.pallas_blocks import EXACT, column, dot, local_cumsum, row, row_of
from kernels.x64 import indicator, iota

f32 = jnp.float32
_TOKEN_FIELDS = ("beta", "G", "first", "last", "start", "doc")  # the per-token scalars, (B, H, N, 6, C)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tokens per chunk. 64: C x C tiles for the MXU without making the inverse's log2 C rounds of
    C^3 matmuls dominate (fla's chunk size too); not tuned on a TPU. Shrunk to the padded sequence
    for short inputs."""

    block_t: int = 64

    def __post_init__(self):
        b = self.block_t
        if not isinstance(b, int) or b < 8 or b & (b - 1):
            raise ValueError(f"BlockSizes.block_t={b!r} must be a power of two >= 8")


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    channel: bool  # a log-decay per key channel (KDA), g (B, H, Tp, K), not per head
    block_t: int
    num_chunks: int
    interpret: bool
    dtype: str  # operand dtype of the dots (the inputs')
    exact: bool  # float32 inputs: HIGHEST precision dots


def _inverse(A):
    """M = (I + A)^{-1} for a strictly lower-triangular (C, C) tile A, C a power of two, by the
    block doubling of the docstring."""
    C = A.shape[0]
    ii, jj = iota((C, C), 0), iota((C, C), 1)
    M = indicator(ii == jj)
    b = 1
    while b < C:
        lower_left = ((ii ^ jj) < 2 * b) & ((ii & b) != 0) & ((jj & b) == 0)
        M = M - dot(dot(M, jnp.where(lower_left, A, 0.0), (1, 0), EXACT), M, (1, 0), EXACT)
        b *= 2
    return M


def _chunk(q_ref, k_ref, v_ref, tok_ref, g_ref, cfg, scores=True):
    """The chunk's inputs and its state-independent terms (all float32); P (the decayed Q' K^T)
    only with `scores`. The per-token scalars come as rows (6, C) (a (C, 6) block would fill a
    (C, 128) tile); they are used as columns (C, 1). g_ref: the per-channel G (C, K), or None. cg,
    kd are (C, 1) for a per-head gate, (C, K) per channel; gamma (1, 1) or (K, 1)."""
    C = cfg.block_t
    ii, jj = iota((C, C), 0), iota((C, C), 1)
    tok = tok_ref[...]  # (6, C)
    rows = [jnp.sum(jnp.where(iota(tok.shape, 0) == i, tok, 0.0), axis=0, keepdims=True) for i in range(len(tok))]
    beta_row, G_row, first_row, last_row, start_row, doc_row = rows  # (1, C) each
    c = SimpleNamespace(beta=column(beta_row), first=column(first_row), start_row=start_row)
    doc, last = column(doc_row), column(last_row) > 0  # (C, 1)
    at_last = lambda x: jnp.sum(jnp.where(iota((1, C), 1) == C - 1, x, 0.0), axis=1, keepdims=True)  # (1, 1)
    c.q, c.k = q_ref[...].astype(f32) * cfg.scale, k_ref[...].astype(f32)  # (C, K)
    c.v = v_ref[...].astype(f32)  # (C, V)
    c.vis = (ii >= jj) & (doc == doc_row)  # (C, C): key j seen by query i
    c.strict = c.vis & (ii != jj)
    keep = at_last(first_row)  # (1, 1): 1 if the state survives the chunk (no document starts in it)
    if cfg.channel:
        c.G = G = g_ref[...]  # (C, K)
        c.P, c.KK = pair_scores(c.q, c.k, G, c.vis, with_q=scores)  # decayed, masked
        G_last = row_of(G, C - 1)  # (1, K)
        c.gamma_row = keep * jnp.exp(G_last)  # (1, K)
        c.gamma = column(c.gamma_row)  # (K, 1): decays the rows of S
    else:
        c.G = G = column(G_row)  # (C, 1)
        G_last = at_last(G_row)
        c.E = jnp.where(c.vis, jnp.exp(jnp.where(c.vis, G - G_row, 0.0)), 0.0)  # masked before exp
        c.KK = dot(c.k, c.k, (1, 1), cfg) * c.E  # (C, C)
        c.P = dot(c.q, c.k, (1, 1), cfg) * c.E if scores else None
        c.gamma = keep * jnp.exp(G_last)  # (1, 1)
    c.M = _inverse(jnp.where(c.strict, c.beta * c.KK, 0.0))
    c.cg = c.first * jnp.exp(G)  # (C, 1) or (C, K)
    c.kd = jnp.where(last, jnp.exp(jnp.where(last, G_last - G, 0.0)), 0.0)  # (C, 1) or (C, K)
    c.Ut = dot(c.M, c.beta * c.v, (1, 0), cfg)  # (C, V)
    c.W = dot(c.M, (c.beta * c.cg) * c.k, (1, 0), cfg)  # (C, K)
    return c


def _fwd_kernel(*refs, cfg, states):
    """Chunk n: writes o (C, V), or with states=True the state entering the chunk (K, V); the final
    state at the last chunk. Refs: q, k, v, tok, [G (per channel)], s0; out, st; the (K, V) state
    scratch S."""
    ins, (s0_ref, out_ref, st_ref, S_ref) = refs[:-4], refs[-4:]
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...]

    c = _chunk(*ins[:4], ins[4] if cfg.channel else None, cfg, scores=not states)
    S = S_ref[...]
    U = c.Ut - dot(c.W, S, (1, 0), cfg)  # (C, V)
    if states:
        out_ref[...] = S
    else:
        out_ref[...] = (dot(c.cg * c.q, S, (1, 0), cfg) + dot(c.P, U, (1, 0), cfg)).astype(out_ref.dtype)
    S = c.gamma * S + dot((c.kd * c.k).T, U, (1, 0), cfg)
    S_ref[...] = S

    @pl.when(n == cfg.num_chunks - 1)
    def _():
        st_ref[...] = S


def _bwd_kernel(*refs, cfg):
    """Chunk N - 1 - n: dq, dk (C, K), dv (C, V), the rows dbeta, dg (2, C) (dg per channel: (C, K)
    in its own output, the row is zero); d initial_state at the last step. Refs: q, k, v, tok, [G],
    h, do, dst; dq, dk, dv, dtok, [dg], ds0; the scratch dS_ref, dL/dS at the chunk's end (K, V),
    carried backwards."""
    m = 5 if cfg.channel else 4
    (q_ref, k_ref, v_ref, tok_ref), g_ref = refs[:4], (refs[4] if cfg.channel else None)
    h_ref, do_ref, dst_ref = refs[m:m + 3]
    dq_ref, dk_ref, dv_ref, dtok_ref = refs[m + 3:m + 7]
    dg_ref = refs[m + 7] if cfg.channel else None
    ds0_ref, dS_ref = refs[-2:]
    n = pl.program_id(2)
    C = cfg.block_t

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dst_ref[...]

    c = _chunk(q_ref, k_ref, v_ref, tok_ref, g_ref, cfg)
    dS, S = dS_ref[...], h_ref[...]  # (K, V) each; S: the state entering the chunk
    U = c.Ut - dot(c.W, S, (1, 0), cfg)
    do = do_ref[...].astype(f32)  # (C, V)
    kdk = c.kd * c.k  # (C, K)
    dU = dot(c.P.T, do, (1, 0), cfg) + dot(kdk, dS, (1, 0), cfg)  # (C, V)
    dW = -dot(dU, S, (1, 1), cfg)  # (C, K)
    MT = c.M.T
    dVb, dKb = dot(MT, dU, (1, 0), cfg), dot(MT, dW, (1, 0), cfg)  # M^T dU, M^T dW
    dA = -jnp.where(c.strict, dot(dVb, c.Ut, (1, 1), cfg) + dot(dKb, c.W, (1, 1), cfg), 0.0)
    dP = jnp.where(c.vis, dot(do, U, (1, 1), cfg), 0.0)  # dL/dP
    dKK = dA * c.beta  # dL/dKK through A
    rowsum = lambda x: jnp.sum(x, axis=1, keepdims=True)  # (C, 1)
    gate = (lambda x: x) if cfg.channel else rowsum  # a (C, K) term reduced to the gate's shape
    if cfg.channel:
        dq, dk, dG = pair_grads(c.q, c.k, c.G, c.vis, dP, dKK)  # dG (C, K): through the pairs' decays
    else:
        dPE, dKE = dP * c.E, dKK * c.E  # w.r.t. the undecayed Q' K^T, K K^T
        dq = dot(dPE, c.k, (1, 0), cfg)
        dk = dot(dPE.T, c.q, (1, 0), cfg) + dot(dKE + dKE.T, c.k, (1, 0), cfg)
        Z = dP * c.P + dKK * c.KK  # (C, C): dL/dD ⊙ D
        dG = rowsum(Z - Z.T)  # (C, 1)
    dQs, dKd = dot(do, S, (1, 1), cfg), dot(U, dS, (1, 1), cfg)  # (C, K) each
    dq_ref[...] = ((dq + c.cg * dQs) * cfg.scale).astype(dq_ref.dtype)
    dk_ref[...] = (dk + (c.beta * c.cg) * dKb + c.kd * dKd).astype(dk_ref.dtype)
    dv_ref[...] = (c.beta * dVb).astype(dv_ref.dtype)
    dbeta = rowsum(dA * c.KK) + rowsum(c.cg * c.k * dKb) + rowsum(c.v * dVb)
    X = gate(kdk * dKd)  # (C, 1) or (C, K): through D_{C-1,j}
    decay = rowsum(dS * S)  # (K, 1): gamma ⊙ this is dL/dgamma (rows of S)
    if cfg.channel:
        to_last = jnp.sum(X, axis=0, keepdims=True) + c.gamma_row * row(decay)  # (1, K)
    else:
        to_last = jnp.sum(X, axis=0, keepdims=True) + c.gamma * jnp.sum(decay, axis=0, keepdims=True)
    dG = (dG + gate(c.cg * (c.q * dQs + c.beta * c.k * dKb)) - X
          + jnp.where(iota((C, 1), 0) == C - 1, to_last, 0.0))  # dL/dG
    # dg_t = sum of dG_s over s >= t in t's chunk and document; 0 at a document start.
    if cfg.channel:
        dg = dot(indicator(c.vis).T, dG, (1, 0), EXACT)  # (C, K)
        dg_ref[...] = jnp.where(column(c.start_row) > 0, 0.0, dg)
        dg_row = jnp.zeros((1, C), f32)
    else:
        dg_row = jnp.where(c.start_row > 0, 0.0, jnp.sum(jnp.where(c.vis, dG, 0.0), axis=0, keepdims=True))
    dtok_ref[...] = jnp.where(iota((2, C), 0) == 0, row(dbeta), dg_row)
    dS = c.gamma * dS + dot((c.cg * c.q).T, do, (1, 0), cfg) - dot(c.W.T, dU, (1, 0), cfg)
    dS_ref[...] = dS

    @pl.when(n == cfg.num_chunks - 1)
    def _():
        ds0_ref[...] = dS


def _specs(cfg, q, v, reverse):
    """BlockSpecs over the grid (batch row, head, chunk); reverse: chunks from last to first."""
    B, H, _, K = q.shape
    C, V, N = cfg.block_t, v.shape[3], cfg.num_chunks
    m = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    return SimpleNamespace(
        grid=(B, H, N),
        qk=pl.BlockSpec((None, None, C, K), lambda b, h, n: (b, h, m(n), 0)),
        v=pl.BlockSpec((None, None, C, V), lambda b, h, n: (b, h, m(n), 0)),
        tok=pl.BlockSpec((None, None, None, len(_TOKEN_FIELDS), C), lambda b, h, n: (b, h, m(n), 0, 0)),
        dtok=pl.BlockSpec((None, None, None, 2, C), lambda b, h, n: (b, h, m(n), 0, 0)),
        st=pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0)),
        h=pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, m(n), 0, 0)))


def _call(kernel, cfg, s, in_specs, out_specs, out_shape, name, *args):
    K, V = args[0].shape[3], args[2].shape[3]
    return pl.pallas_call(
        kernel, grid=s.grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)], name=name,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
    )(*args)


def _forward(cfg, q, k, v, tok, G, s0, states=False):
    """(o (B, H, Tp, V) or the chunks' start states (B, H, N, K, V), final state (B, H, K, V)). G: the
    per-channel cumulative gates (B, H, Tp, K), None for a per-head gate (in tok)."""
    s = _specs(cfg, q, v, reverse=False)
    B, H, _, K = q.shape
    out = ((s.h, jax.ShapeDtypeStruct((B, H, cfg.num_chunks, K, v.shape[3]), f32)) if states
           else (s.v, jax.ShapeDtypeStruct(v.shape, q.dtype)))
    gate = [G] if cfg.channel else []
    return _call(functools.partial(_fwd_kernel, cfg=cfg, states=states), cfg, s,
                 [s.qk, s.qk, s.v, s.tok] + [s.qk] * len(gate) + [s.st], [out[0], s.st],
                 [out[1], jax.ShapeDtypeStruct(s0.shape, f32)],
                 "delta_rule_states_tpu" if states else "delta_rule_fwd_tpu", q, k, v, tok, *gate, s0)


def _prepare(cfg, q, k, v, beta, g, masks, s0):
    """The kernels' inputs: q, k, v, the per-token scalars of _TOKEN_FIELDS by chunk, (B, H, N, 6, C),
    the per-channel cumulative gates G (B, H, Tp, K) (None for a per-head gate, whose G is a field)
    and s0; masks (B, 4, Tp): first, last, start, doc."""
    B, H, Tp = beta.shape
    G = local_cumsum(g, cfg.block_t, axis=2) if cfg.channel else None
    G_field = jnp.zeros_like(beta) if cfg.channel else local_cumsum(g, cfg.block_t, axis=-1)
    fields = jnp.concatenate([beta[:, :, None], G_field[:, :, None],
                              jnp.broadcast_to(masks[:, None], (B, H, 4, Tp))], axis=2)  # (B, H, 6, Tp)
    tok = jnp.swapaxes(fields.reshape(B, H, len(_TOKEN_FIELDS), cfg.num_chunks, cfg.block_t), 2, 3)
    return q, k, v, tok, G, s0


def _backward(cfg, res, cts):
    q, k, v, tok, G, s0 = res
    do, dst = cts
    h, _ = _forward(cfg, *res, states=True)
    s = _specs(cfg, q, v, reverse=True)
    B, H, Tp, _ = q.shape
    gate = [G] if cfg.channel else []
    outs = _call(
        functools.partial(_bwd_kernel, cfg=cfg), cfg, s,
        [s.qk, s.qk, s.v, s.tok] + [s.qk] * len(gate) + [s.h, s.v, s.st],
        [s.qk, s.qk, s.v, s.dtok] + [s.qk] * len(gate) + [s.st],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((B, H, cfg.num_chunks, 2, cfg.block_t), f32)]
        + [jax.ShapeDtypeStruct(x.shape, f32) for x in gate] + [jax.ShapeDtypeStruct(s0.shape, f32)],
        "delta_rule_bwd_tpu", q, k, v, tok, *gate, h, do.astype(q.dtype), dst)
    (dq, dk, dv, dtok), ds0 = outs[:4], outs[-1]
    dbeta, dg = (dtok[:, :, :, i].reshape(B, H, Tp) for i in (0, 1))
    return dq, dk, dv, dbeta, outs[4] if cfg.channel else dg, None, ds0


_delta_rule = launch.recompute_vjp(_prepare, _forward, _backward)


def delta_rule_pallas_tpu(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                          beta: Float[Array, "B T H"], g: Float[Array, "B T H"] | Float[Array, "B T H K"] | None = None,
                          *, scale: float, segment_ids: Int[Array, "B T"] | None = None,
                          initial_state: Float[Array, "B H K V"] | None = None,
                          block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """The function, arguments and result of delta_rule_pallas (the GPU kernels), on a TPU.
    interpret=None: the TPU interpreter everywhere but on a TPU."""
    B, T, H, K = q.shape
    check_delta_rule_shapes("delta_rule_pallas_tpu", q, k, v, beta, g)
    C = min((block_sizes or BlockSizes()).block_t, max(8, pl.next_power_of_2(T)))
    N = -(-T // C)
    Tp = N * C
    channel = g is not None and g.ndim == 4
    cfg = _Config(scale=float(scale), channel=channel, block_t=C, num_chunks=N,
                  interpret=jax.default_backend() != "tpu" if interpret is None else interpret,
                  dtype=jnp.dtype(q.dtype).name, exact=q.dtype == f32)
    heads = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))  # (B, H, Tp, D)
    tok = lambda x: jnp.pad(jnp.swapaxes(x.astype(f32), 1, 2), ((0, 0), (0, 0), (0, Tp - T)))  # (B, H, Tp)
    g = jnp.zeros((B, H, Tp), f32) if g is None else heads(g.astype(f32)) if channel else tok(g)
    doc, prev = launch.document_rows(segment_ids, B, T, Tp)  # (B, Tp) each
    chunks = doc.reshape(B, N, C)
    first = chunks == prev.reshape(B, N, C)[:, :, :1]  # same document as the token before the chunk
    last = chunks == chunks[:, :, -1:]  # in the chunk's last document
    masks = jnp.stack([first.reshape(B, Tp), last.reshape(B, Tp), doc != prev, doc], axis=1).astype(f32)  # (B, 4, Tp)
    s0 = launch.padded_state(initial_state, B, H, K, v.shape[3])
    o, st = _delta_rule(cfg, heads(q), heads(k), heads(v), tok(beta), g, masks, s0)
    return jnp.swapaxes(o, 1, 2)[:, :T], st
