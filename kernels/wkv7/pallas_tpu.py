"""WKV7 (RWKV-7's generalised delta rule; Peng et al., 2025, arXiv:2503.14456) as Pallas TPU kernels
(Mosaic TPU), forward and backward, in the chunked WY/UT form of chunk.py (the DPLR chunk form of
fla's chunk_dplr_delta_rule). In the (K, V) state convention of reference.py:

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T r_t

Grid (B, H, N chunks), the chunk axis last and sequential ("arbitrary"): each step brings one chunk
of C tokens into VMEM and carries the (K, V) float32 state in a VMEM scratch buffer. Per chunk
entering with state S, with G = the chunk-local inclusive cumulative log decay, G^- = the exclusive
one (G^-_t = G_{t-1}), G_l = G_{C-1} and, for a query row t and key row s of one document,
D_ts = e^{G_t - G_s} (s <= t) and D^-_ts = e^{G^-_t - G_s} (s < t), per channel:

    A^rk_ts = sum_k r_tk k_sk D_tsk,  A^rb (r, b, D),  A^ak (a, k, D^-),  A^ab (a, b, D^-)
    X  = (a ⊙ e^{G^-}) S + A^ak V,     SA = T X,   T = (I - A^ab)^{-1}   (the UT transform)
    O  = (r ⊙ e^{G}) S + A^rk V + A^rb SA                                 (sa_t = a_t^T S_{t-1}: row t of SA)
    S' = diag(e^{G_l}) S + (k ⊙ e^{G_l - G})^T V + (b ⊙ e^{G_l - G})^T SA

Backward, a reverse-time kernel (index maps n -> N - 1 - n) carrying dS = dL/dS' in VMEM scratch
(starting from the final state's cotangent), with S the chunk's entering state:

    dSA = A^rb^T dO + b_out dS,   dX = T^T dSA,   dV = A^rk^T dO + k_out dS + A^ak^T dX
    dA^rk = dO V^T, dA^rb = dO SA^T, dA^ak = dX V^T, dA^ab = dX SA^T      (masked like the scores)
    dS_prev = r_in^T dO + diag(e^{G_l}) dS + a_in^T dX                   (dS_-1: d initial_state)

then dr, dk, da, db through the scores (a loop over the chunk's keys) and the in/out decays, and
dG, dG^- by the chain rule (a score's decay gives q ⊙ dq to its query row's exponent and -κ ⊙ dκ to
its key row's); dlog w_t = sum_{s >= t} dG_s + sum_{s > t} dG^-_s over t's chunk and document (later
documents add exactly zero), 0 at a document start, where w_t multiplies a zero state.

Stability and exactness for any decay: D and D^- are never split into e^{G_t} e^{-G_s} (e^{-G_s}
overflows for fast decays); the kernels loop over the chunk's keys s and compute e^{G_t - G_s} for
all queries at once with the exponent set to 0 where t < s before exp (as kernels/gla/pallas.py), so
every exponent is <= 0. T = (I - A^ab)^{-1} = (I + A)(I + A^2)(I + A^4)... up to A^{C-1} (A is strictly
lower triangular, so A^C = 0): 2 (log2(C) - 1) C x C matmuls, in float32 at HIGHEST precision.

Documents (segment_ids) are masks, as in chunk.py: scores only inside one document; S reaches only
tokens of the document entering the chunk (`cont`); only the chunk's last document writes S'
(`last`); S survives the chunk only if no document starts in it. Padding: T is padded to a multiple
of C with r = k = v = a = b = 0 and log w = 0 (inert), joined to the last document.

Memory: the forward keeps nothing; the backward first reruns the forward kernel writing each
chunk's entering state, (B, H, N, K, V) float32 = 4 K V T / C bytes per (row, head) in HBM, alive
only during the backward (fla's chunk kernels store the same h). Residuals from forward to backward
are the inputs only.

Code names: `r_in` = r ⊙ e^G (masked by cont), `a_in` = a ⊙ e^{G^-}, `tail` = e^{G_l - G} (masked by
last), `k_out`, `b_out` = k, b ⊙ tail, `g_end` = e^{G_l} as a (K, 1) column (0 when a document
starts in the chunk), `Tm` = T, `flags` the per-token (doc, cont, last, start) columns. Paper
symbols (reference.py): r -> r_t, w_log -> log w_t, k -> k~_t, v -> v_t, a -> -kappa^_t,
b -> kappa^_t * a_t.

Departures from the GPU kernel (pallas.py, the same maths) and from fla:
- a grid over chunks with the state in VMEM scratch (GPU: one program walks all chunks in a
  fori_loop; fla: separate kernels for the UT transform, the states h and the output);
- G, G^- computed in the kernel as matmuls with triangular ones (GPU, fla: cumulative sums in XLA,
  the GPU kernel keeping them as residuals);
- one level of chunking with the pairwise decays per key (fla: 16-token sub-chunks joined through
  reference points);
- T by the product form (GPU: forward substitution; fla: forward substitution on 16-blocks merged
  by matmuls);
- no value blocks: each program holds all V columns (the scores are shared by them); the state is
  kept (K, V), and a per-channel decay of it is a (K, 1) column (GPU: S^T with a row);
- dot operands in float32, HIGHEST precision (Mosaic's fp32 contraction) for float32 inputs,
  DEFAULT (Mosaic's default, bfloat16 MXU passes) for bfloat16 inputs, except the triangular-ones
  sums (G, G^-, dlog w) and the inverse's squarings, always HIGHEST.

Backend: Mosaic TPU is the only Pallas TPU backend. Off a TPU the kernels run in the TPU interpreter
(pltpu.InterpretParams); `jax.jit(...).trace(...).lower(lowering_platforms=("tpu",))` checks that
Mosaic accepts them without a TPU.
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels import pallas_launch as launch
from kernels.pallas_blocks import col_of, row_of
from kernels.wkv7.pallas import check_wkv7_shapes
from kernels.x64 import fori_loop, indicator, iota

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_t: tokens per chunk, a multiple of 8 (the float32 sublane tile; bfloat16 inputs on a TPU
    want a multiple of 16), shrunk to T rounded up to 16 for short calls. Not tuned on a TPU: 32
    balances the per-key decay loop (C steps of (C, K) VPU work per chunk) against the MXU's
    contraction length (C) and the backward's stored states (K V T / C floats per row and head)."""

    block_t: int = 32

    def __post_init__(self):
        if self.block_t < 8 or self.block_t % 8:
            raise ValueError(f"BlockSizes.block_t={self.block_t} must be a positive multiple of 8")


@dataclasses.dataclass(frozen=True)
class _Config:
    block_t: int
    num_chunks: int
    exact: bool  # float32 inputs: HIGHEST-precision dots
    interpret: bool



def _mm(x, y, exact=True):
    """x @ y, float32."""
    precision = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    return lax.dot_general(x, y, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=f32)


def _mm_nt(x, y, exact=True):
    """x @ y^T, float32."""
    precision = lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)


def _decays(G, Gm, Gj, j):
    """e^{G_t - G_j} (t >= j) and e^{G^-_t - G_j} (t > j) for all t (C, K); exponents masked to 0
    before exp elsewhere (they would be positive), so nothing overflows."""
    t = iota((G.shape[0], 1), 0)
    return jnp.exp(jnp.where(t >= j, G - Gj, 0.0)), jnp.exp(jnp.where(t > j, Gm - Gj, 0.0))


def _chunk(r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, fl_ref, row_ref, cfg):
    """The chunk's inputs (float32) and everything of the docstring that does not depend on S."""
    C = cfg.block_t
    r, lw, k, a, b = (x[...].astype(f32) for x in (r_ref, w_ref, k_ref, a_ref, b_ref))  # (C, K)
    v = v_ref[...].astype(f32)  # (C, V)
    fl = fl_ref[...]  # (C, 4)
    doc, cont, last, start = (col_of(fl, i) for i in range(4))  # (C, 1)
    ti, si = iota((C, C), 0), iota((C, C), 1)
    same = doc == row_ref[...]  # (C, C): same document ((C, 1) against the (1, C) doc row)
    incl, strict = (ti >= si) & same, (ti > si) & same
    G = _mm(indicator(ti >= si), lw)  # (C, K): chunk-local cumulative sums, exact dots
    Gm = _mm(indicator(ti > si), lw)
    Gl, carry = row_of(G, C - 1), row_of(cont, C - 1)  # (1, K), (1, 1)
    eG, eGm = jnp.exp(G), jnp.exp(Gm)
    r_in = jnp.where(cont > 0, r * eG, 0.0)
    a_in = jnp.where(cont > 0, a * eGm, 0.0)
    tail = jnp.where(last > 0, jnp.exp(Gl - G), 0.0)  # G_l - G_t <= 0
    g_end = jnp.exp(col_of(G.T, C - 1)) * carry  # (K, 1)

    def key(j, As):  # column j of the four scores, unmasked
        Ark, Arb, Aak, Aab = As
        Gj, kj, bj = row_of(G, j), row_of(k, j), row_of(b, j)  # (1, K)
        E, Em = _decays(G, Gm, Gj, j)
        rE, aE = r * E, a * Em
        put = lambda A, x: jnp.where(iota((1, C), 1) == j, jnp.sum(x, axis=1, keepdims=True), A)
        return put(Ark, rE * kj), put(Arb, rE * bj), put(Aak, aE * kj), put(Aab, aE * bj)

    zero = jnp.zeros((C, C), f32)
    Ark, Arb, Aak, Aab = fori_loop(0, C, key, (zero,) * 4)
    Ark, Arb = jnp.where(incl, Ark, 0.0), jnp.where(incl, Arb, 0.0)
    Aak, Aab = jnp.where(strict, Aak, 0.0), jnp.where(strict, Aab, 0.0)
    Tm, P, p = indicator(ti == si) + Aab, Aab, 1  # (I - A)^{-1} = prod_i (I + A^{2^i})
    while 2 * p < C:
        P = _mm(P, P)
        Tm, p = Tm + _mm(Tm, P), 2 * p
    return SimpleNamespace(
        r=r, k=k, v=v, a=a, b=b, G=G, Gm=Gm, eG=eG, eGm=eGm, cont=cont, start=start, ti=ti, si=si, same=same,
        incl=incl, strict=strict, r_in=r_in, a_in=a_in, tail=tail, k_out=k * tail, b_out=b * tail, g_end=g_end,
        g_row=jnp.exp(Gl) * carry, Ark=Ark, Arb=Arb, Aak=Aak, Aab=Aab, Tm=Tm)


def _fwd_kernel(*refs, cfg, states):
    """Writes o (C, V) per chunk, or with states=True the state entering each chunk; and S_T."""
    ins, s0_ref, out_ref, st_ref, S_ref = refs[:8], refs[8], refs[9], refs[10], refs[11]
    n, ex = pl.program_id(2), cfg.exact

    @pl.when(n == 0)
    def _():
        S_ref[...] = s0_ref[...]

    c = _chunk(*ins, cfg)
    S, v = S_ref[...], c.v  # (K, V)
    SA = _mm(c.Tm, _mm(c.a_in, S, ex) + _mm(c.Aak, v, ex), ex)  # (C, V)
    if states:
        out_ref[...] = S
    else:
        o = _mm(c.r_in, S, ex) + _mm(c.Ark, v, ex) + _mm(c.Arb, SA, ex)
        out_ref[...] = o.astype(out_ref.dtype)
    S = c.g_end * S + _mm(c.k_out.T, v, ex) + _mm(c.b_out.T, SA, ex)
    S_ref[...] = S

    @pl.when(n == cfg.num_chunks - 1)
    def _():
        st_ref[...] = S


def _bwd_kernel(*refs, cfg):
    ins, h_ref, do_ref, dst_ref = refs[:8], refs[8], refs[9], refs[10]
    dr_ref, dw_ref, dk_ref, dv_ref, da_ref, db_ref, ds0_ref, dS_ref = refs[11:]
    n, ex, C = pl.program_id(2), cfg.exact, cfg.block_t

    @pl.when(n == 0)
    def _():
        dS_ref[...] = dst_ref[...]

    c = _chunk(*ins, cfg)
    S, dS, v, do = h_ref[...], dS_ref[...], c.v, do_ref[...].astype(f32)  # (K, V), (K, V), (C, V), (C, V)
    X = _mm(c.a_in, S, ex) + _mm(c.Aak, v, ex)
    SA = _mm(c.Tm, X, ex)
    dSA = _mm(c.Arb.T, do, ex) + _mm(c.b_out, dS, ex)
    dX = _mm(c.Tm.T, dSA, ex)
    dv_ref[...] = _mm(c.Ark.T, do, ex) + _mm(c.k_out, dS, ex) + _mm(c.Aak.T, dX, ex)
    dArk, dArb = (jnp.where(c.incl, _mm_nt(do, x, ex), 0.0) for x in (v, SA))
    dAak, dAab = (jnp.where(c.strict, _mm_nt(dX, x, ex), 0.0) for x in (v, SA))
    dr_in, da_in = _mm_nt(do, S, ex), _mm_nt(dX, S, ex)  # (C, K)
    dk_out, db_out = _mm_nt(v, dS, ex), _mm_nt(SA, dS, ex)
    dg_end = _mm_nt(jnp.ones((1, S.shape[1]), f32), S * dS)  # (1, K): sum_v S dS
    dS_ref[...] = _mm(c.r_in.T, do, ex) + c.g_end * dS + _mm(c.a_in.T, dX, ex)

    r, k, a, b, G, Gm = c.r, c.k, c.a, c.b, c.G, c.Gm

    def key(j, acc):  # through the scores' column j: dr, da (all rows) and dk, db (row j)
        dr, da, dk, db = acc
        Gj, kj, bj = row_of(G, j), row_of(k, j), row_of(b, j)
        E, Em = _decays(G, Gm, Gj, j)
        c_rk, c_rb, c_ak, c_ab = (col_of(M, j) for M in (dArk, dArb, dAak, dAab))  # (C, 1)
        rE, aE = r * E, a * Em
        row_j = iota((C, 1), 0) == j
        dk = jnp.where(row_j, jnp.sum(c_rk * rE + c_ak * aE, axis=0, keepdims=True), dk)
        db = jnp.where(row_j, jnp.sum(c_rb * rE + c_ab * aE, axis=0, keepdims=True), db)
        return dr + (c_rk * kj + c_rb * bj) * E, da + (c_ak * kj + c_ab * bj) * Em, dk, db

    zero = jnp.zeros(r.shape, f32)
    dr_s, da_s, dk_s, db_s = fori_loop(0, C, key, (zero,) * 4)
    cont, tail, k_out, b_out = c.cont > 0, c.tail, c.k_out, c.b_out
    dr_ref[...] = dr_s + jnp.where(cont, dr_in * c.eG, 0.0)
    da_ref[...] = da_s + jnp.where(cont, da_in * c.eGm, 0.0)
    dk_ref[...] = dk_s + dk_out * tail
    db_ref[...] = db_s + db_out * tail
    # dL/dG_l: the write decays e^{G_l - G_s} and the state's e^{G_l} (g_end as a row: e^{G_l} or 0).
    out = k_out * dk_out + b_out * db_out
    dGl = jnp.sum(out, axis=0, keepdims=True) + c.g_row * dg_end  # (1, K)
    dG = (r * dr_s + c.r_in * dr_in - k * dk_s - b * db_s - out
          + jnp.where(iota((C, 1), 0) == C - 1, dGl, 0.0))
    dGm = a * da_s + c.a_in * da_in
    # G_s = sum_{t <= s} log w_t, G^-_s = sum_{t < s}: suffix sums inside t's document.
    suffix = indicator((c.si >= c.ti) & c.same)  # (t, s)
    dw = _mm(suffix, dG + dGm) - dGm
    dw_ref[...] = jnp.where(c.start > 0, 0.0, dw)

    @pl.when(n == cfg.num_chunks - 1)
    def _():
        ds0_ref[...] = dS_ref[...]


def _specs(cfg, K, V, reverse=False):
    N = cfg.num_chunks
    idx = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    tok = lambda D: pl.BlockSpec((None, None, cfg.block_t, D), lambda b, h, n: (b, h, idx(n), 0))
    return SimpleNamespace(
        k=tok(K), v=tok(V),
        flags=pl.BlockSpec((None, cfg.block_t, 4), lambda b, h, n: (b, idx(n), 0)),  # (B, Tp, 4)
        docrow=pl.BlockSpec((None, None, 1, cfg.block_t), lambda b, h, n: (b, idx(n), 0, 0)),  # (B, N, 1, C)
        state=pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0)),
        states=pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, idx(n), 0, 0)))


def _call(kernel, cfg, in_specs, out_specs, out_shape, scratch, name, *args):
    B, H = args[0].shape[:2]
    return pl.pallas_call(
        kernel, grid=(B, H, cfg.num_chunks), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM(scratch, f32)], name=name,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
    )(*args)


def _forward(cfg, *xs, states=False):
    """xs = (r, w, k, v, a, b, flags, docrow, s0), (B, H, Tp, D) layout. (o or per-chunk states, S_T)."""
    xs, s0 = xs[:-1], xs[-1]
    r, v = xs[0], xs[3]
    B, H, _, K = r.shape
    V = v.shape[3]
    s = _specs(cfg, K, V)
    out = ((s.states, jax.ShapeDtypeStruct((B, H, cfg.num_chunks, K, V), f32)) if states
           else (s.v, jax.ShapeDtypeStruct(v.shape, r.dtype)))
    in_specs = [s.k] * 3 + [s.v] + [s.k] * 2 + [s.flags, s.docrow, s.state]
    return _call(functools.partial(_fwd_kernel, cfg=cfg, states=states), cfg, in_specs,
                 [out[0], s.state], [out[1], jax.ShapeDtypeStruct(s0.shape, f32)], (K, V),
                 "wkv7_states" if states else "wkv7_fwd", *xs, s0)


def _backward(cfg, res, cts):
    xs, s0 = res[:-1], res[-1]
    do, dst = cts
    h, _ = _forward(cfg, *res, states=True)
    r, v = xs[0], xs[3]
    K, V = r.shape[3], v.shape[3]
    s = _specs(cfg, K, V, reverse=True)
    in_specs = [s.k] * 3 + [s.v] + [s.k] * 2 + [s.flags, s.docrow, s.states, s.v, s.state]
    out_specs = [s.k] * 3 + [s.v] + [s.k] * 2 + [s.state]
    shapes = [jax.ShapeDtypeStruct(x.shape, f32) for x in xs[:6]] + [jax.ShapeDtypeStruct(s0.shape, f32)]
    grads = _call(functools.partial(_bwd_kernel, cfg=cfg), cfg, in_specs, out_specs, shapes, (K, V),
                  "wkv7_bwd", *xs, h, do, dst.astype(f32))
    return tuple(g.astype(x.dtype) for g, x in zip(grads[:6], xs)) + (None, None, grads[6])


_wkv7 = launch.recompute_vjp(lambda cfg, *xs: xs, _forward, _backward)  # the kernels take the inputs as they are


def wkv7_pallas_tpu(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                    v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
                    segment_ids: Int[Array, "B T"] | None = None,
                    initial_state: Float[Array, "B H K V"] | None = None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """The function, arguments and result of wkv7_pallas (the GPU kernels), on a TPU. interpret=None:
    the TPU interpreter everywhere but on a TPU."""
    B, T, H, K = r.shape
    V = v.shape[3]
    check_wkv7_shapes("wkv7_pallas_tpu", r, w_log, k, v, a, b)
    C = min((block_sizes or BlockSizes()).block_t, 16 * -(-T // 16))
    N = -(-T // C)
    Tp = N * C
    cfg = _Config(block_t=C, num_chunks=N, exact=r.dtype == f32,
                  interpret=jax.default_backend() != "tpu" if interpret is None else interpret)
    tr = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, Tp - T), (0, 0)))  # (B, H, Tp, D)
    doc, prev = launch.document_rows(segment_ids, B, T, Tp)  # (B, Tp) each
    chunks = doc.reshape(B, N, C)
    entering = prev[:, ::C, None]  # (B, N, 1): the document of the state entering each chunk
    flags = jnp.stack([chunks, chunks == entering, chunks == chunks[..., -1:], (doc != prev).reshape(B, N, C)],
                      axis=-1).astype(f32).reshape(B, Tp, 4)  # (doc, cont, last, start)
    docrow = chunks.astype(f32)[:, :, None, :]  # (B, N, 1, C)
    s0 = launch.padded_state(initial_state, B, H, K, V)
    o, st = _wkv7(cfg, tr(r), tr(w_log), tr(k), tr(v), tr(a), tr(b), flags, docrow, s0)
    return jnp.swapaxes(o, 1, 2)[:, :T], st
