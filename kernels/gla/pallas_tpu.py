"""Gated linear attention as Pallas TPU kernels (Yang et al., 2024, arXiv:2312.06635, the chunkwise
form): the function of kernels/gla/pallas.py (its docstring has the forward and backward
equations) on a TPU-shaped grid. With chunks of C tokens, b_i the log-decay summed from the chunk's
start to token i, q' = scale q:

    O_[n] = (Q' ⊙ e^{b}) S_[n-1] + A V,    A_ij = [j <= i] sum_k q'_ik k_jk e^{b_ik - b_jk}
    S_[n] = diag(e^{b_{C-1}}) S_[n-1] + (K ⊙ e^{b_{C-1} - b})^T V

Grid (B, H, V / block_v, chunks), the chunk axis last and sequential ("arbitrary"), the others
"parallel". BlockSpecs bring one chunk of q, k (query/key head h // (H / G)), v, the gates and the
document ids into VMEM per step; the state S^T (block_v, K) float32 lives in a VMEM scratch buffer
carried across the chunk steps (set from the initial state at chunk 0, written out at the last).
Three kernels: the forward; dQ, chunks in order, recomputing S_[n-1] in its scratch; dK/dV, chunks
in reverse (index maps N - 1 - n), carrying dS_[n] from the final state's cotangent to d initial
state. No per-chunk state is stored: the backward's memory is that of the inputs plus dq and dk
per value block (float32, summed in XLA).

Intra-chunk scores. A scalar gate (g (B, T, H): retention, linear attention, Mamba-2's SSD)
makes the decay the (C, C) tile e^{b_i - b_j}, masked before exp, and every product a matmul.
A per-channel gate (g (B, T, H, K)) has no exact matrix form for e^{b_i - b_j}. Factoring it through
one reference point r for the whole chunk, (q_i e^{b_i - b_r}) . (k_j e^{b_r - b_j}), overflows
for keys after r when the decay is strong. As fla's chunk_gla, the chunk is split into sub-chunks of
c = block_sub tokens and r is the first token of the query's sub-chunk, used only for keys j < r:
then b_i <= b_r <= b_j (g is a log-decay, <= 0), both exponents are <= 0, nothing overflows for any
gate strength, and the product is exact: one masked (C, K) x (K, C) matmul per sub-chunk. Pairs
inside a sub-chunk (j <= i) take a loop over the c key offsets (fla: over the keys of one sub-chunk
per program), here serving all sub-chunks at once: at offset o, row i reads key start(i) + o,
gathered (and in dK scattered back) by a 0/1 matmul, and e^{b_i - b_key} is formed on the (C, K)
tile with its exponent masked to 0 where the key is not visible (i < key, or another document).
Nothing is approximated: each score is the token loop's, up to float32 rounding.

Gate gradient: the state-free identity of kernels/gla/pallas.py, in XLA after the kernels, with the
helpers `local_cumsum` and `doc_suffix_sum` (kernels/pallas_blocks.py): dg_t = sum over s >= t of
(q_s . dq_s - k_s . dk_s) (+ rowsum(dS_T ⊙ S_T) at the last token) within t's document, 0 at a
document start.

Documents: doc(t) counts the document starts up to t; A needs doc(i) == doc(j); the carried state
is seen only by tokens of the document of the token before the chunk, kept only if the chunk holds
no start, and updated only by keys of the chunk's last document (as pallas.py and chunk.py).

Backend: Mosaic TPU, the only Pallas backend for TPUs. Off a TPU the kernels run in the TPU
interpreter (pltpu.InterpretParams), where the tests check them; `.lower(lowering_platforms=
("tpu",))` checks that they lower to Mosaic. They have not run on a TPU.

Code names: `St` is S^T (block_v, K), so a per-channel decay is a row that broadcasts; `qd` =
Q' ⊙ e^{b}, `kd` = K ⊙ e^{b_{C-1} - b} (document-masked), `decay` = e^{b_{C-1}}, `M` the (C, C)
visibility mask, `E` the scalar gate's masked e^{b_i - b_j}, `P` the 0/1 key-gather matrix.

Departures from the GPU kernel (pallas.py) and from fla:
- layout (B, H, T, D) inside (one transpose of each input and output in XLA): a TPU block's last
  two dims must be multiples of (8, 128) or whole, so the head axis cannot sit between T and D;
- per-channel gates: two-level chunking as fla (C = 64, c = 16) where the GPU kernel loops over all
  C keys of a 16-token chunk; the in-sub-chunk loop gathers its keys with 0/1 matmuls (2 to 3
  extra (C, C) x (C, K) products per offset, not measured) instead of loading one key row at a time;
- the scores and pairwise exponentials are recomputed in both backward kernels, as on GPU;
- K is not padded; V is padded to a multiple of block_v when V > block_v; T to the chunk (zero
  inputs and gates, inert); the chunk shrinks to T rounded up to block_sub for short sequences;
- dq and dk per value block and per value head are summed in XLA, as in the GPU version.
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
from kernels.gla.pallas import GLAOptions, gate_grad, gla_options, group_heads
from kernels.pallas_blocks import local_cumsum
from kernels.x64 import div, fori_loop, indicator, iota

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tokens per chunk (block_t), per sub-chunk of a per-channel gate (block_sub, a power of two
    dividing block_t), value columns per program (block_v); multiples of 8. On a TPU block_v must be
    a multiple of 128 or at least V (Mosaic's tiling); smaller values are for the interpreter."""

    block_t: int = 64
    block_sub: int = 16
    block_v: int = 128

    def __post_init__(self):
        for name in ("block_t", "block_sub", "block_v"):
            b = getattr(self, name)
            if b < 8 or b % 8:
                raise ValueError(f"BlockSizes.{name}={b} must be a positive multiple of 8")
        if self.block_t % self.block_sub or self.block_sub & (self.block_sub - 1):
            raise ValueError(f"BlockSizes.block_sub={self.block_sub} must be a power of two dividing "
                             f"block_t={self.block_t}")


BLOCK_SIZES = {
    # Not tuned (no TPU measurement yet). 128-wide value blocks fill the MXU of v5e/v6e. Per-channel
    # gates: 64-token chunks in 16-token sub-chunks (16 loop steps per chunk); a scalar gate: all
    # matmuls, 128-token chunks.
    "channel": BlockSizes(block_t=64, block_sub=16, block_v=128),
    "scalar": BlockSizes(block_t=128, block_sub=16, block_v=128),
}


def default_block_sizes(scalar_gate: bool = False) -> BlockSizes:
    return BLOCK_SIZES["scalar" if scalar_gate else "channel"]


@dataclasses.dataclass(frozen=True)
class _Config(GLAOptions):
    block_t: int
    block_sub: int
    block_v: int
    num_chunks: int
    interpret: bool
    dtype: str  # operand dtype of the dots (the inputs')
    exact: bool  # float32 inputs: full-precision dots


def _dot(a, b, dims, cfg, exact=None):
    """a @ b contracting a's axis dims[0] with b's axis dims[1] (2-D), float32 result. A transposed
    left operand is transposed explicitly (float32) before the cast."""
    exact = cfg.exact if exact is None else exact
    if dims[0] == 0:
        a, dims = a.astype(f32).T, (1, dims[1])
    dtype = f32 if exact else cfg.dtype
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((dims[0],), (dims[1],)), ((), ())),
                           precision=lax.Precision.HIGHEST if exact else lax.Precision.DEFAULT,
                           preferred_element_type=f32)



def _load(r, cfg):
    """This step's chunk: q' (C, K), k (C, K) float32, the decays and masks of the docstring."""
    C = cfg.block_t
    c = SimpleNamespace(q=r.q[...].astype(f32) * cfg.scale, k=r.k[...].astype(f32), b=r.b[...])
    b_last = r.b[C - 1:C, :]  # (1, K) or (1, 1)
    c.M = iota((C, C), 0) >= iota((C, C), 1)  # key j visible from query i
    c.q_decay, c.k_decay, c.decay = jnp.exp(c.b), jnp.exp(b_last - c.b), jnp.exp(b_last)
    if cfg.segmented:
        doc = r.doc[...]  # (C, 1)
        state_doc, doc_last = r.prev[0:1, :], r.doc[C - 1:C, :]  # (1, 1): documents of t0 - 1, t0 + C - 1
        c.M = c.M & (doc == r.doc_row[...])
        keep = indicator  # masks broadcast as numbers, not booleans
        c.q_decay = c.q_decay * keep(doc == state_doc)
        c.k_decay = c.k_decay * keep(doc == doc_last)
        c.decay = c.decay * keep(doc_last == state_doc)
    if cfg.scalar:  # e^{b_i - b_j}, zero where not visible; masked before exp
        c.E = jnp.where(c.M, jnp.exp(jnp.where(c.M, c.b - r.b_row[...], 0.0)), 0.0)
    c.qd, c.kd = c.q * c.q_decay, c.k * c.k_decay  # (C, K)
    return c


def _scores(c, cfg, dA=None, want=("A",)):
    """Of the intra-chunk scores: A (C, C) and, from dA = dL/dA (masked), dL/dq' and dL/dk (C, K);
    those named in `want`, as a dict."""
    if cfg.scalar:
        out = {}
        if "A" in want:
            out["A"] = _dot(c.q, c.k, (1, 1), cfg) * c.E
        if "dq" in want:
            out["dq"] = _dot(dA * c.E, c.k, (1, 0), cfg)
        if "dk" in want:
            out["dk"] = _dot(dA * c.E, c.q, (0, 0), cfg)
        return out
    C, sub = cfg.block_t, cfg.block_sub
    row = iota(c.k.shape, 0)  # (C, K)
    zero = jnp.zeros((C, C) if "A" in want else (1, 1), f32), jnp.zeros(c.k.shape, f32)
    A, dq, dk = zero[0], zero[1], zero[1]
    # Keys in earlier sub-chunks, through the first token r of the query's sub-chunk: exponents <= 0.
    for s in range(1, C // sub):
        r = s * sub
        rows, keys = (row >= r) & (row < r + sub), row < r  # (C, K)
        eq = jnp.exp(jnp.where(rows, c.b - c.b[r:r + 1, :], 0.0))
        ek = jnp.exp(jnp.where(keys, c.b[r:r + 1, :] - c.b, 0.0))
        qr, kr = jnp.where(rows, c.q * eq, 0.0), jnp.where(keys, c.k * ek, 0.0)  # (C, K)
        if "A" in want:
            A = A + _dot(qr, kr, (1, 1), cfg)
        if "dq" in want:
            dq = dq + jnp.where(rows, _dot(dA, kr, (1, 0), cfg) * eq, 0.0)
        if "dk" in want:
            dk = dk + jnp.where(keys, _dot(dA, qr, (0, 0), cfg) * ek, 0.0)
    if "A" in want:
        A = jnp.where(c.M, A, 0.0)
    # Keys in the query's own sub-chunk, offset o: row i reads key start(i) + o. The gathers are
    # exact: one 1 per row of P, and k in the dots' dtype (b in float32).
    i = iota((C, 1), 0)
    start, col = i - jnp.bitwise_and(i, sub - 1), iota((1, C), 1)

    def offset(o, carry):
        A, dq, dk = carry
        P = col == start + o  # (C, C)
        Pf = indicator(P)
        vis = jnp.max(indicator(P & c.M), axis=1, keepdims=True)  # (C, 1): 1 if visible
        b_key, k_key = _dot(Pf, c.b, (1, 0), cfg, exact=True), _dot(Pf, c.k, (1, 0), cfg)
        E = jnp.exp((c.b - b_key) * vis)  # (C, K), exponent masked to 0 where not visible
        if "A" in want:
            A = A + jnp.where(P, vis * jnp.sum(c.q * k_key * E, axis=1, keepdims=True), 0.0)
        if dA is not None:
            da = vis * jnp.sum(jnp.where(P, dA, 0.0), axis=1, keepdims=True)  # (C, 1): dA_{i, key}
            if "dq" in want:
                dq = dq + da * k_key * E
            if "dk" in want:
                dk = dk + _dot(Pf, da * c.q * E, (0, 0), cfg, exact=True)  # scatter to the keys
        return A, dq, dk

    A, dq, dk = fori_loop(0, sub, offset, (A, dq, dk))
    return {name: x for name, x in (("A", A), ("dq", dq), ("dk", dk)) if name in want}


def _first(dst, src):
    @pl.when(pl.program_id(3) == 0)
    def _():
        dst[...] = src[...]


def _last(cfg, dst, src):
    @pl.when(pl.program_id(3) == cfg.num_chunks - 1)
    def _():
        dst[...] = src[...]


def _fwd_kernel(r, cfg):
    _first(r.S, r.s0)
    c, v, St = _load(r, cfg), r.v[...], r.S[...]  # v (C, bv); St (bv, K)
    A = _scores(c, cfg)["A"]
    r.o[...] = (_dot(c.qd, St, (1, 1), cfg) + _dot(A, v, (1, 0), cfg)).astype(r.o.dtype)
    r.S[...] = St * c.decay + _dot(v, c.kd, (0, 0), cfg)
    _last(cfg, r.st, r.S)


def _dq_kernel(r, cfg):
    _first(r.S, r.s0)
    c, v, do, St = _load(r, cfg), r.v[...], r.do[...], r.S[...]
    dA = jnp.where(c.M, _dot(do, v, (1, 1), cfg), 0.0)  # (C, C)
    dq = _dot(do, St, (1, 0), cfg) * c.q_decay + _scores(c, cfg, dA, ("dq",))["dq"]  # w.r.t. q'
    r.dq[...] = dq * cfg.scale
    r.S[...] = St * c.decay + _dot(v, c.kd, (0, 0), cfg)


def _dkv_kernel(r, cfg):
    _first(r.S, r.dst)  # S holds dS_[n]^T, chunks in reverse
    c, v, do, dSt = _load(r, cfg), r.v[...], r.do[...], r.S[...]
    dA = jnp.where(c.M, _dot(do, v, (1, 1), cfg), 0.0)
    out = _scores(c, cfg, dA, ("A", "dk"))
    r.dk[...] = out["dk"] + _dot(v, dSt, (1, 0), cfg) * c.k_decay
    r.dv[...] = (_dot(c.kd, dSt, (1, 1), cfg) + _dot(out["A"], do, (0, 0), cfg)).astype(r.dv.dtype)
    r.S[...] = dSt * c.decay + _dot(do, c.qd, (0, 0), cfg)
    _last(cfg, r.ds0, r.S)


def _call(kernel, cfg, ins, outs, name, reverse=False):
    """pallas_call over the grid (B, H, V / block_v, chunks). ins / outs: name -> (kind, array or
    ShapeDtypeStruct); the kind picks the BlockSpec; chunks run in reverse if `reverse`."""
    N, R, C = cfg.num_chunks, cfg.groups, cfg.block_t
    t = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    K, (B, H, _, Vp), bv = ins["q"][1].shape[3], ins["v"][1].shape, cfg.block_v
    specs = {
        "qk": pl.BlockSpec((None, None, C, K), lambda b, h, j, n: (b, div(h, R), t(n), 0)),
        "v": pl.BlockSpec((None, None, C, bv), lambda b, h, j, n: (b, h, t(n), j)),
        "b": pl.BlockSpec((None, None, C, 1 if cfg.scalar else K), lambda b, h, j, n: (b, h, t(n), 0)),
        "b_row": pl.BlockSpec((None, None, None, 1, C), lambda b, h, j, n: (b, h, t(n), 0, 0)),
        "col": pl.BlockSpec((None, C, 1), lambda b, h, j, n: (b, t(n), 0)),
        "row": pl.BlockSpec((None, None, 1, C), lambda b, h, j, n: (b, t(n), 0, 0)),
        "state": pl.BlockSpec((None, None, bv, K), lambda b, h, j, n: (b, h, j, 0)),
        "part": pl.BlockSpec((None, None, None, C, K), lambda b, h, j, n: (j, b, h, t(n), 0)),
    }
    names = list(ins) + list(outs) + ["S"]

    def body(*refs):
        kernel(SimpleNamespace(**dict(zip(names, refs))), cfg)

    return pl.pallas_call(
        body, grid=(B, H, Vp // bv, N), name=name,
        in_specs=[specs[kind] for kind, _ in ins.values()],
        out_specs=[specs[kind] for kind, _ in outs.values()],
        out_shape=[shape for _, shape in outs.values()],
        scratch_shapes=[pltpu.VMEM((bv, K), f32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
    )(*(a for _, a in ins.values()))


def _chunk_inputs(q, k, v, g, docs, cfg):
    """The inputs every kernel reads, with the gates' chunk-local cumulative sums b."""
    b = jnp.swapaxes(local_cumsum(g, cfg.block_t), 1, 2)  # (B, H, Tp, K), or (B, H, Tp) for a scalar gate
    ins = {"q": ("qk", q), "k": ("qk", k), "v": ("v", v)}
    if cfg.scalar:
        B, H, Tp = b.shape
        ins["b"] = ("b", b[..., None])
        ins["b_row"] = ("b_row", b.reshape(B, H, Tp // cfg.block_t, 1, cfg.block_t))
    else:
        ins["b"] = ("b", b)
    if cfg.segmented:
        doc, prev = docs
        B, Tp = doc.shape
        ins.update(doc=("col", doc[..., None]), prev=("col", prev[..., None]),
                   doc_row=("row", doc.reshape(B, Tp // cfg.block_t, 1, cfg.block_t)))
    return ins


def _forward(q, k, v, g, docs, s0t, cfg):
    ins = _chunk_inputs(q, k, v, g, docs, cfg) | {"s0": ("state", s0t)}
    outs = {"o": ("v", jax.ShapeDtypeStruct(v.shape, q.dtype)),
            "st": ("state", jax.ShapeDtypeStruct(s0t.shape, f32))}
    return _call(_fwd_kernel, cfg, ins, outs, "gla_tpu_fwd")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gla(q, k, v, g, docs, s0t, cfg):
    return _forward(q, k, v, g, docs, s0t, cfg)


def _gla_fwd(q, k, v, g, docs, s0t, cfg):
    o, st = _forward(q, k, v, g, docs, s0t, cfg)
    return (o, st), (q, k, v, g, docs, s0t, st)


def _gla_bwd(cfg, res, cts):
    q, k, v, g, docs, s0t, st = res
    do, dst = cts
    B, G, Tp, K = q.shape
    H, R = v.shape[1], cfg.groups
    ins = _chunk_inputs(q, k, v, g, docs, cfg) | {"do": ("v", do.astype(q.dtype))}
    part = jax.ShapeDtypeStruct((v.shape[3] // cfg.block_v, B, H, Tp, K), f32)
    (dq,) = _call(_dq_kernel, cfg, ins | {"s0": ("state", s0t)}, {"dq": ("part", part)}, "gla_tpu_dq")
    dk, dv, ds0t = _call(_dkv_kernel, cfg, ins | {"dst": ("state", dst)},
                         {"dk": ("part", part), "dv": ("v", jax.ShapeDtypeStruct(v.shape, v.dtype)),
                          "ds0": ("state", jax.ShapeDtypeStruct(s0t.shape, f32))},
                         "gla_tpu_dkv", reverse=True)
    dq, dk = dq.sum(0), dk.sum(0)  # (B, H, Tp, K), per value head
    doc, prev = docs if cfg.segmented else (jnp.zeros((B, Tp), jnp.int32),) * 2
    dg = gate_grad(q, k, dq, dk, dst, st, doc, prev, cfg, heads=1)
    group = lambda x: group_heads(x, R, heads=1)  # (B, G, Tp, K)
    return group(dq).astype(q.dtype), group(dk).astype(k.dtype), dv, dg.astype(g.dtype), None, ds0t


_gla.defvjp(_gla_fwd, _gla_bwd)


def gla_pallas_tpu(q: Float[Array, "B T G K"], k: Float[Array, "B T G K"], v: Float[Array, "B T H V"],
                   g: Float[Array, "B T H K"] | Float[Array, "B T H"], *, scale: float = 1.0,
                   segment_ids: Int[Array, "B T"] | None = None,
                   initial_state: Float[Array, "B H K V"] | None = None,
                   block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Same function as gla_reference (and gla_pallas), differentiable in q, k, v, g and
    initial_state. Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32).

    g (B, T, H, K): one log-decay (<= 0) per channel; g (B, T, H): one per head. q and k may have
    G heads with G dividing H. interpret=None: the TPU interpreter everywhere but on a TPU.
    """
    B, T, G, K = q.shape
    H, V = v.shape[2:]
    opts = gla_options("gla_pallas_tpu", q, k, v, g, scale, segment_ids)
    blocks = block_sizes or default_block_sizes(opts.scalar)
    sub = blocks.block_sub
    C = min(blocks.block_t, -(-T // sub) * sub)  # a multiple of block_sub
    bv = min(V, blocks.block_v)
    Tp, Vp = -(-T // C) * C, -(-V // bv) * bv
    cfg = _Config(**dataclasses.asdict(opts), block_t=C, block_sub=min(sub, C), block_v=bv, num_chunks=Tp // C,
                  interpret=jax.default_backend() != "tpu" if interpret is None else interpret,
                  dtype=jnp.dtype(q.dtype).name, exact=q.dtype == f32)
    pad = lambda x, d: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, d - x.shape[3])))
    heads_first = lambda x, d: jnp.swapaxes(pad(x, d), 1, 2)  # (B, H, Tp, d)
    g = jnp.pad(g, ((0, 0), (0, Tp - T)) + ((0, 0),) * (g.ndim - 2))
    docs = launch.document_rows(segment_ids, B, T, Tp) if opts.segmented else None  # doc, prev (B, Tp)
    s0t = launch.padded_state(initial_state, B, H, K, Vp, transpose=True)  # (B, H, Vp, K)
    o, st = _gla(heads_first(q, K), heads_first(k, K), heads_first(v, Vp), g, docs, s0t, cfg)
    return jnp.swapaxes(o, 1, 2)[:, :T, :, :V], jnp.swapaxes(st, 2, 3)[:, :, :, :V]
