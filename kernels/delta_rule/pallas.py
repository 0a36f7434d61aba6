"""The (gated) delta rule in Pallas: DeltaNet (Yang et al., 2024, arXiv:2406.06484, sec. 3, the
chunkwise WY/UT form), Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2024, arXiv:2412.06464,
sec. 3.3) and Kimi Delta Attention (Kimi Team, 2025, "Kimi Linear"; a gate per key channel),
forward and backward as Pallas kernels fused over chunks: one program per (value block, batch row,
head) walks the sequence chunk by chunk with the (K, V) state on chip.

Per chunk of C tokens entering with state S, with q' = scale q, G_i = sum of g over the chunk up to
token i, Gamma_i = e^{G_i}, D_ij = e^{G_i - G_j} for j <= i (0 otherwise):

    A = strict_tril(diag(beta) (K K^T ⊙ D))       M = (I + A)^{-1}      (unit lower-triangular)
    W = M diag(beta Gamma) K,   U~ = M diag(beta) V,   U = U~ - W S           (the UT transform)
    O = diag(Gamma) Q' S + (Q' K^T ⊙ D) U
    S_next = Gamma_{C-1} S + (diag(D_{C-1,:}) K)^T U

Backward, reverse over chunks carrying dS = dL/dS_next (dS_T: the final state's cotangent), with
P = Q' K^T ⊙ D and S the chunk's start state:

    dU = P^T dO + diag(D_{C-1,:}) K dS              dW = -dU S^T
    dV~ = M^T dU (dv = beta dV~),   dK~ = M^T dW,   dA = -strict_tril(dV~ U~^T + dK~ W^T)
    dS_prev = Gamma_{C-1} dS + (diag(Gamma) Q')^T dO - W^T dU           (dS_-1: d initial_state)

then dq, dk, dbeta and dg by the chain rule through A, P, W, U~ and the decays (_bwd_kernel): with
Z = dP ⊙ P + dA ⊙ A, the decay pairs give dG_i += sum_j Z_ij - sum_j Z_ji, and dg_t is the sum of
dG_s over s >= t in t's chunk and document (the inverse of the chunk-local cumsum; terms of later
documents cancel exactly, so they are left out), 0 at a document start where the gate multiplies a
zero state.

Per key channel (KDA, g (B, T, H, K); reference.py: S_t = (I - beta_t k_t k_t^T) diag(e^{g_t}) S_{t-1}
+ beta_t k_t v_t^T): the same derivation with G_i in R^K the chunk-local cumulative log-decay, c_i
the incoming-state mask, and the decay inside each product over k instead of outside it:

    A = strict_tril(diag(beta) ((K ⊙ e^{G}) (K ⊙ e^{-G})^T)), masked to same-document pairs
      i.e. A_ij = beta_i sum_k k_ik k_jk e^{G_ik - G_jk}            M = (I + A)^{-1}
    W = M diag(beta) (c ⊙ e^{G} ⊙ K),   U~ = M diag(beta) V,   U = U~ - W S
    P_ij = sum_k q'_ik k_jk e^{G_ik - G_jk} (j <= i, same document),   O = (c ⊙ e^{G} ⊙ Q') S + P U
    S_next = diag(gamma) S + (K ⊙ e^{G_{C-1} - G})^T U,   gamma = e^{G_{C-1}} in R^K

The (K ⊙ e^{G}) (K ⊙ e^{-G})^T form is never computed: e^{-G} overflows float32 once a channel has
decayed past e^-88 inside the chunk (4.4 tokens at g = -20). P and K K^T decayed come from
pairwise.py: a loop over the chunk's keys j forming e^{G_i - G_j} for all queries at once, with the
exponent masked to 0 before exp where i < j (as kernels/gla/pallas.py), so every exponential in
the kernels has an exponent <= 0 (also c e^{G}, e^{G_{C-1} - G} and gamma) and nothing overflows
for any gate <= 0. Backward: dU, dW, dV~, dK~, dA and dS_prev as above with diag(gamma); with
dP = dO U^T and dKK = diag(beta) dA (masked), the loop's pullback (pairwise.pair_grads) gives the
pairs' dq', dk and dG = q' ⊙ dq'_pairs + k ⊙ (dk_row - dk_key); then per channel

    dG += c e^{G} ⊙ (Q' ⊙ dO S^T + diag(beta) K ⊙ dK~) - X,   X = K ⊙ e^{G_{C-1} - G} ⊙ (U dS^T)
    dG_{C-1} += sum_j X_j + gamma ⊙ rowsum(dS ⊙ S)
    dg_t = sum of dG_s over s >= t in t's chunk and document (a 0/1 matmul, float32), 0 at a start

(a per-head gate is the same with every (C, K) term summed over k). The gate enters HBM as
(B, Tp, H, K) float32 like q, its gradient as partial sums per value block.

Memory: the backward needs each chunk's start state. Running the delta rule backwards would invert
I - beta k k^T (singular at beta = 1), so a third kernel recomputes the states forward in the
backward pass and writes them to HBM: (T / C) * K * V float32 per (batch row, head), alive only
during the backward (as fla's chunk_gated_delta_rule_bwd, which recomputes h the same way). The
residuals kept from forward to backward are the inputs only; M, W and U~ are recomputed per chunk.

Code names: `N` = M^T (the inverse is built transposed, one column per step, by forward
substitution, so no tile is transposed on chip), `E` = D masked to the chunk's documents, `cg` =
c ⊙ Gamma (c_i: token i sees the incoming state), `kd` = D_{C-1,:} masked to the chunk's last
document, `gamma` = the decay of S across the chunk, `Ut` = U~, `dVb`, `dKb` = dV~, dK~; `P`, `KK`
the decayed Q' K^T and K K^T (masked), `cfg.channel` a per-channel gate, then `cg`, `kd` (C, K),
`gamma` a (K, 1) column (from the (1, K) row `gamma_row` by a diagonal mask: no transposes on chip).

Documents: doc(t) counts the document starts up to t; D, A, P are masked to doc(i) == doc(j); the
incoming state reaches only tokens of the document of the token before the chunk (c), it survives
the chunk only if no document starts in it, and only the chunk's last document writes the state.

Backend. On GPU the kernels are lowered through Triton (pltriton.CompilerParams), for the reason
kernels/attention/pallas.py and kernels/gla/pallas.py give: this plain-jnp grid + BlockSpec kernel
does not lower to Mosaic GPU in jax 0.10.2 (no dot_general rule there), runs unchanged in interpret
mode where the tests check it, and lets Triton pick the tensor-core instructions. Without a GPU,
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` checks that the three kernels lower
to Triton IR; that Triton compiles and runs them is checked only by the tests marked gpu, not yet
run. The TPU kernels are in pallas_tpu.py.

Departures from the papers and from fla:
- one kernel per direction walks all chunks (fla: separate kernels for the UT transform, the
  per-chunk states h, the output, and the WY backward, with A, w, u and h written to HBM);
- M = (I + A)^{-1} by forward substitution over the whole C x C tile, C steps of C^2 on CUDA cores
  (fla's solve_tril: 16 x 16 diagonal blocks by substitution, merged by matmuls);
- dq, dk, dbeta, dg of each value block are partial sums, added over the value blocks in XLA (fla
  sums over its value blocks the same way);
- the chunk-local cumulative gates G are computed in XLA (as fla's chunk_local_cumsum);
- per-channel gates: the pairwise decays by a loop over all C keys on CUDA cores (fla's chunk_kda:
  16-token sub-chunks joined by tensor-core matmuls through a reference point; not measured), with
  the same 32-token chunks as a per-head gate (not tuned), and no clamp of the gate (fla's optional
  safe_gate / lower_bound, for its M = 16 tensor-core path; the loop needs none);
- T is padded to the chunk, K and V to powers of two >= 16 (Triton dots), with zero inputs, beta and
  gates, which neither write nor decay the state; every dot casts its operands to the inputs' dtype
  (bfloat16 inputs: M, W and the state enter the tensor cores in bfloat16, accumulating in float32).
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels import pallas_launch as launch
from kernels.delta_rule.pairwise import pair_grads, pair_scores
from kernels.pallas_blocks import (  # noqa: F401 (supports: re-exported)
    EXACT,
    BlockSizes,
    column,
    dot,
    local_cumsum,
    row,
    row_of,
    supports,
    unit_lower_inverse_t,
)
from kernels.x64 import fori_loop, indicator, iota

f32 = jnp.float32


# Not tuned (no GPU measurement yet). 32-token chunks keep the C-step substitution and the
# backward's (C, K) tiles small; fla uses 64.
default_block_sizes = launch.block_defaults(gpu=BlockSizes(block_t=32, block_v=64))


@dataclasses.dataclass(frozen=True)
class _Config(launch.ChunkConfig):
    scale: float
    channel: bool  # a log-decay per key channel (KDA), g (B, T, H, K), not per head


def _chunk(n, refs, cfg, scores=True):
    """Chunk n's inputs and the state-independent terms of the docstring (all float32); P (the
    decayed Q' K^T) only with `scores`. cg, kd are (C, 1) for a per-head gate, (C, K) per channel;
    gamma a scalar or (K, 1) (it decays the rows of S)."""
    q_ref, k_ref, v_ref, beta_ref, g_ref, doc_ref, prev_ref = refs
    C = cfg.block_t
    t0 = pl.multiple_of(n * C, C)
    sl = pl.ds(t0, C)
    c = SimpleNamespace(sl=sl, q=q_ref[sl, :].astype(f32) * cfg.scale, k=k_ref[sl, :].astype(f32),
                        v=v_ref[sl, :].astype(f32), beta=beta_ref[sl], doc=doc_ref[sl])
    doc = c.doc
    state_doc, doc_last = jnp.min(prev_ref[sl]), jnp.max(doc)  # documents of token t0 - 1 and t0 + C - 1
    c.vis = (iota((C, C), 0) >= iota((C, C), 1)) & (doc[:, None] == doc[None, :])  # key j seen by query i
    c.strict = c.vis & (iota((C, C), 0) != iota((C, C), 1))
    c.start = doc != prev_ref[sl]  # (C,): a document starts here
    first, last = (doc == state_doc)[:, None], (doc == doc_last)[:, None]  # (C, 1)
    if cfg.channel:
        c.G = G = g_ref[sl, :]  # (C, K)
        c.P, c.KK = pair_scores(c.q, c.k, G, c.vis, with_q=scores)
        G_last = row_of(G, C - 1)  # (1, K)
        c.gamma_row = jnp.where(doc_last == state_doc, jnp.exp(G_last), 0.0)  # (1, K)
        c.gamma = column(c.gamma_row)  # (K, 1)
    else:
        g = g_ref[sl]  # (C,)
        G, G_last = g[:, None], jnp.sum(jnp.where(iota((C,), 0) == C - 1, g, 0.0))
        c.E = jnp.where(c.vis, jnp.exp(jnp.where(c.vis, G - g[None, :], 0.0)), 0.0)  # masked before exp
        c.KK = dot(c.k, c.k, (1, 1), cfg) * c.E  # (C, C)
        c.P = dot(c.q, c.k, (1, 1), cfg) * c.E if scores else None
        c.gamma = jnp.where(doc_last == state_doc, jnp.exp(G_last), 0.0)  # scalar
    c.A = jnp.where(c.strict, c.beta[:, None] * c.KK, 0.0)
    c.N = unit_lower_inverse_t(c.A)
    c.cg = jnp.where(first, jnp.exp(G), 0.0)  # (C, 1) or (C, K)
    c.kd = jnp.where(last, jnp.exp(jnp.where(last, G_last - G, 0.0)), 0.0)  # (C, 1) or (C, K)
    c.Ut = dot(c.N, c.beta[:, None] * c.v, (0, 0), cfg)  # (C, bv): M diag(beta) V
    c.Kb = (c.beta[:, None] * c.cg) * c.k  # (C, K)
    c.W = dot(c.N, c.Kb, (0, 0), cfg)  # (C, K)
    return c


def _fwd_kernel(*refs, cfg, states):
    """With states=False writes o (Tp, bv); with states=True the state entering each chunk
    (N*K, bv) instead. Both write the final state."""
    ins, s0_ref, out_ref, st_ref = refs[:7], refs[7], refs[8], refs[9]
    K = ins[0].shape[1]

    def chunk(n, S):  # S (K, bv): the state entering chunk n
        c = _chunk(n, ins, cfg, scores=not states)
        U = c.Ut - dot(c.W, S, (1, 0), cfg)  # (C, bv)
        if states:
            out_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = S
        else:
            o = dot(c.cg * c.q, S, (1, 0), cfg) + dot(c.P, U, (1, 0), cfg)
            out_ref[c.sl, :] = o.astype(out_ref.dtype)
        return c.gamma * S + dot(c.kd * c.k, U, (0, 0), cfg)

    st_ref[...] = fori_loop(0, ins[0].shape[0] // cfg.block_t, chunk, s0_ref[...])


def _bwd_kernel(*refs, cfg):
    ins, h_ref, do_ref, dst_ref = refs[:7], refs[7], refs[8], refs[9]
    dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, ds0_ref = refs[10:]
    C, K = cfg.block_t, ins[0].shape[1]
    num_chunks = ins[0].shape[0] // C
    # A per-channel term (C, K) reduced to the gate's shape: itself, or summed over K for a per-head gate.
    gate = (lambda x: x) if cfg.channel else (lambda x: jnp.sum(x, axis=1, keepdims=True))

    def chunk(i, dS):  # dS (K, bv): dL/dS at the end of chunk n
        n = num_chunks - 1 - i
        c = _chunk(n, ins, cfg)
        S = h_ref[pl.ds(pl.multiple_of(n * K, K), K), :]  # (K, bv): the state entering chunk n
        U = c.Ut - dot(c.W, S, (1, 0), cfg)
        do = do_ref[c.sl, :]
        kdk = c.kd * c.k  # (C, K)
        dU = dot(c.P, do, (0, 0), cfg) + dot(kdk, dS, (1, 0), cfg)  # (C, bv)
        dW = -dot(dU, S, (1, 1), cfg)  # (C, K)
        dVb, dKb = dot(c.N, dU, (1, 0), cfg), dot(c.N, dW, (1, 0), cfg)  # M^T dU, M^T dW
        dA = -jnp.where(c.strict, dot(dVb, c.Ut, (1, 1), cfg) + dot(dKb, c.W, (1, 1), cfg), 0.0)
        dP = jnp.where(c.vis, dot(do, U, (1, 1), cfg), 0.0)  # dL/dP
        dKK = dA * c.beta[:, None]  # dL/dKK through A
        if cfg.channel:
            dq, dk, dG = pair_grads(c.q, c.k, c.G, c.vis, dP, dKK)  # dG (C, K): through the pairs' decays
        else:
            dPE, dKE = dP * c.E, dKK * c.E  # w.r.t. the undecayed Q' K^T, K K^T
            dq = dot(dPE, c.k, (1, 0), cfg)
            dk = dot(dPE, c.q, (0, 0), cfg) + dot(dKE, c.k, (1, 0), cfg) + dot(dKE, c.k, (0, 0), cfg)
            Z = dP * c.P + dKK * c.KK  # (C, C): dL/dD ⊙ D
            dG = (jnp.sum(Z, axis=1) - jnp.sum(Z, axis=0))[:, None]  # (C, 1)
        dQs, dKd = dot(do, S, (1, 1), cfg), dot(U, dS, (1, 1), cfg)  # (C, K) each
        dq_ref[c.sl, :] = (dq + c.cg * dQs) * cfg.scale
        dk_ref[c.sl, :] = dk + c.cg * c.beta[:, None] * dKb + c.kd * dKd
        dv_ref[c.sl, :] = (c.beta[:, None] * dVb).astype(dv_ref.dtype)
        dbeta_ref[c.sl] = jnp.sum(dA * c.KK, axis=1) + jnp.sum(c.cg * c.k * dKb, axis=1) + jnp.sum(c.v * dVb, axis=1)
        X = gate(kdk * dKd)  # (C, 1) or (C, K): through D_{C-1,j}
        decay = jnp.sum(dS * S, axis=1, keepdims=True)  # (K, 1): gamma ⊙ this is dL/dgamma (rows of S)
        if cfg.channel:
            to_last = jnp.sum(X, axis=0, keepdims=True) + c.gamma_row * row(decay)  # (1, K)
        else:
            to_last = jnp.sum(X) + c.gamma * jnp.sum(decay)
        dG = (dG + gate(c.cg * (c.q * dQs + c.beta[:, None] * c.k * dKb)) - X
              + jnp.where(iota((C, 1), 0) == C - 1, to_last, 0.0))  # dL/dG
        # dg_t = sum of dG_s over s >= t in t's chunk and document; 0 at a document start.
        if cfg.channel:
            dg = dot(indicator(c.vis), dG, (0, 0), EXACT)  # (C, K)
            dg_ref[c.sl, :] = jnp.where(c.start[:, None], 0.0, dg)
        else:
            dg = jnp.sum(jnp.where(c.vis, dG, 0.0), axis=0)
            dg_ref[c.sl] = jnp.where(c.start, 0.0, dg)
        return c.gamma * dS + dot(c.cg * c.q, do, (0, 0), cfg) - dot(c.W, dU, (0, 0), cfg)

    ds0_ref[...] = fori_loop(0, num_chunks, chunk, dst_ref[...])


def _specs(cfg, q, v):
    """BlockSpecs over the grid (value block, batch row, head)."""
    Tp, H, K = q.shape[1:]
    bv = cfg.block_v
    num_chunks = Tp // cfg.block_t
    return SimpleNamespace(
        grid=(v.shape[3] // bv, q.shape[0], H),
        qk=pl.BlockSpec((None, Tp, None, K), lambda j, b, h: (b, 0, h, 0)),
        v=pl.BlockSpec((None, Tp, None, bv), lambda j, b, h: (b, 0, h, j)),
        tok=pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0)),  # beta, a per-head g: (B, H, Tp)
        row=pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),  # doc, prev: (B, Tp)
        st=pl.BlockSpec((None, None, K, bv), lambda j, b, h: (b, h, 0, j)),
        h=pl.BlockSpec((None, None, num_chunks * K, bv), lambda j, b, h: (b, h, 0, j)),
        part_qk=pl.BlockSpec((None, None, Tp, None, K), lambda j, b, h: (j, b, 0, h, 0)),
        part_tok=pl.BlockSpec((None, None, None, Tp), lambda j, b, h: (j, b, h, 0)))


def _gate_specs(cfg, s):
    """The gate's BlockSpec and that of its partial gradients: per channel (B, Tp, H, K) as q."""
    return (s.qk, s.part_qk) if cfg.channel else (s.tok, s.part_tok)


def _forward(cfg, q, k, v, beta, G, doc, prev, s0, states=False):
    """(o or the per-chunk start states (B, H, N*K, V), final state)."""
    s = _specs(cfg, q, v)
    B, Tp, H, K = q.shape
    out = ((s.h, jax.ShapeDtypeStruct((B, H, Tp // cfg.block_t * K, v.shape[3]), f32)) if states
           else (s.v, jax.ShapeDtypeStruct(v.shape, q.dtype)))
    return launch.triton_call(functools.partial(_fwd_kernel, cfg=cfg, states=states), cfg, s.grid,
                       [s.qk, s.qk, s.v, s.tok, _gate_specs(cfg, s)[0], s.row, s.row, s.st], [out[0], s.st],
                       [out[1], jax.ShapeDtypeStruct(s0.shape, f32)],
                       "delta_rule_states" if states else "delta_rule_fwd", q, k, v, beta, G, doc, prev, s0)


def _prepare(cfg, q, k, v, beta, g, doc, prev, s0):
    """g summed from each chunk's start (local_cumsum of this file's layouts: (B, H, Tp) per head,
    (B, Tp, H, K) per channel)."""
    return q, k, v, beta, local_cumsum(g, cfg.block_t, axis=1 if cfg.channel else -1), doc, prev, s0


def _backward(cfg, res, cts):
    q, k, v, beta, G, doc, prev, s0 = res
    do, dst = cts
    h, _ = _forward(cfg, *res, states=True)
    s = _specs(cfg, q, v)
    part_qk = jax.ShapeDtypeStruct((s.grid[0], *q.shape), f32)
    part_tok = jax.ShapeDtypeStruct((s.grid[0], *beta.shape), f32)
    g_spec, dg_spec = _gate_specs(cfg, s)
    dq, dk, dv, dbeta, dg, ds0 = launch.triton_call(
        functools.partial(_bwd_kernel, cfg=cfg), cfg, s.grid,
        [s.qk, s.qk, s.v, s.tok, g_spec, s.row, s.row, s.h, s.v, s.st],
        [s.part_qk, s.part_qk, s.v, s.part_tok, dg_spec, s.st],
        [part_qk, part_qk, jax.ShapeDtypeStruct(v.shape, v.dtype), part_tok,
         jax.ShapeDtypeStruct((s.grid[0], *G.shape), f32), jax.ShapeDtypeStruct(s0.shape, f32)],
        "delta_rule_bwd", q, k, v, beta, G, doc, prev, h, do.astype(q.dtype), dst)
    # Partial sums over the value blocks.
    return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv, dbeta.sum(0), dg.sum(0), None, None, ds0)


_delta_rule = launch.recompute_vjp(_prepare, _forward, _backward)


def check_delta_rule_shapes(where: str, q, k, v, beta, g):
    """Refuse q, k, v, beta, g whose shapes do not agree (the Pallas wrappers' check)."""
    B, T, H, K = q.shape
    launch.check_shapes(where, "q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H) and g (B, T, H) or (B, T, H, K)",
                 k.shape == q.shape and v.shape[:3] == (B, T, H) and beta.shape == (B, T, H)
                 and (g is None or g.shape in ((B, T, H), (B, T, H, K))),
                 q=q, k=k, v=v, beta=beta, g=g)


def delta_rule_pallas(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                      beta: Float[Array, "B T H"], g: Float[Array, "B T H"] | Float[Array, "B T H K"] | None = None,
                      *, scale: float, segment_ids: Int[Array, "B T"] | None = None,
                      initial_state: Float[Array, "B H K V"] | None = None,
                      block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Same function as delta_rule_recurrent, differentiable in q, k, v, beta, g and initial_state.
    Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32). g (B, T, H): a log-decay
    per head (Gated DeltaNet); (B, T, H, K): per key channel (Kimi Delta Attention); None: plain
    DeltaNet. interpret=None: interpret mode everywhere but on GPU."""
    B, T, H, K = q.shape
    V = v.shape[3]
    check_delta_rule_shapes("delta_rule_pallas", q, k, v, beta, g)
    channel = g is not None and g.ndim == 4
    sizes, Tp, Kp, Vp = launch.chunk_launch(block_sizes or default_block_sizes(), T, K, V, q.dtype, interpret)
    cfg = _Config(scale=float(scale), channel=channel, **sizes)
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, d - x.shape[3])))  # (B, Tp, H, d)
    tok = lambda x: jnp.pad(jnp.swapaxes(x.astype(f32), 1, 2), ((0, 0), (0, 0), (0, Tp - T)))  # (B, H, Tp)
    g = jnp.zeros((B, H, Tp), f32) if g is None else pad(g.astype(f32), Kp) if channel else tok(g)
    doc, prev = launch.document_rows(segment_ids, B, T, Tp)  # (B, Tp) each
    s0 = launch.padded_state(initial_state, B, H, Kp, Vp)
    o, st = _delta_rule(cfg, pad(q, Kp), pad(k, Kp), pad(v, Vp), tok(beta), g, doc, prev, s0)
    return o[:, :T, :, :V], st[:, :, :K, :V]
