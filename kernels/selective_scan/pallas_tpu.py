"""Selective scan of Mamba-1 as Pallas TPU (Mosaic) kernels, forward and backward (Gu & Dao, 2023,
arXiv:2312.00752, Algorithm 2 and the hardware-aware scan of Section 3.3.2). Same function, maths
and arguments as pallas.py (the GPU kernels; its docstring derives the backward):

    h_t = a_t ⊙ h_{t-1} + (Δ_t x_t) B_t,   a_t = exp(Δ_t A) (0 at a document start)
    y_t = C_t h_t + D x_t
    dh_t = C_t dy_t + a_{t+1} dh_{t+1},  w_t = dh_t ⊙ a_t ⊙ h_{t-1}
    dx_t = Δ_t (dh_t · B_t) + D dy_t     dΔ_t = x_t (dh_t · B_t) + Σ_n w_t A
    dB_t = Σ_d dh_t Δ_t x_t              dC_t = Σ_d dy_t h_t
    dA = Σ_t w_t Δ_t    dD = Σ_t dy_t x_t    d(initial state) = a_0 ⊙ dh_0

Code names: x -> x (u in the official code), dt -> Δ (already softplus'd by the caller), A, B, C, D
as in reference.py, h the state, keep = 1 - (document start), a_t = exp(Δ_t A) * keep_t.

Grid (batch row b, channel block j, chunk n), chunks last and "arbitrary" (sequential), the others
"parallel". The state is stored transposed, h (N, block_d) float32 in a VMEM scratch buffer, so the
channels lie on the 128 lanes and each token's update is an (N, block_d) elementwise op with x_t,
Δ_t as (1, block_d) rows and B_t, C_t as (N, 1) columns. h is set from the initial state at n = 0,
carried across the chunk steps on chip, never written per step, and written out once at the last
chunk. Each BlockSpec step brings one chunk of L tokens into VMEM: x, Δ (and y, dy, dx, dΔ) as
(L, block_d) tiles, B, C as (N, L) tiles (transposed in XLA, time on the lanes), keep as (1, L).
Inside a chunk a fori_loop walks groups of 8 tokens (one aligned (8, block_d) load/store per group)
and unrolls the 8 tokens; a token's column B_t, C_t is picked from the (N, L) tile by a masked lane
sum (Mosaic has no dynamic lane slice), and its row of y is merged into the group tile by a select.

Backward (the same grid, chunks in reverse through the index maps, n -> NC - 1 - n): dh is carried
in a second VMEM scratch buffer, starting from the final state's cotangent. The forward stores the
state entering every chunk, (B, T/L, N, Dm) float32 in HBM, i.e. (T/L) * Dm * N floats per batch
row (at L = 128, N = 16: Dm * T / 8 floats, an eighth of x in float32). Per chunk the backward
recomputes the chunk's L states from its entering state into a VMEM scratch (L, N, block_d) float32
(2 MiB at the defaults and N = 16), then walks the tokens in reverse. The per-token dB_t, dC_t
columns are merged into (N, L) tiles and written once per chunk.

Reductions, as in pallas.py: each program writes partial sums (dB, dC per channel block, dA, dD per
batch row, the last two accumulated in their output blocks, which stay in VMEM across the chunk
axis) and XLA adds them, which keeps the backward deterministic.

Every input enters the kernels in float32 (cast in XLA, where jax differentiates the casts): a
16-bit tile is (16, 128), so float32 keeps each 8-token group load aligned, and the extra HBM
traffic is small next to the sequential per-token work.

Backend: Mosaic TPU, the only Pallas backend for TPU. Off a TPU the kernels run in the TPU
interpreter (interpret=None picks it). Without a TPU, the tests lower both kernels to Mosaic (which
checks block shapes and that every op has a Mosaic lowering); that Mosaic compiles and runs them on
a TPU is not verified yet.

Departures from the GPU kernel (pallas.py): the grid adds the chunk axis (the GPU program keeps the
whole sequence in its refs and loops over chunks); the state is (N, channels), not (channels, N);
channel blocks must be multiples of 128 (or all of Dm) and chunks multiples of 8, and of 128 unless
one chunk covers T (Mosaic's (8, 128) tiling), where the GPU wants powers of two; the kernels see
float32 only; N is padded to a multiple of 8, not a power of two; the backward keeps the chunk's
states in VMEM scratch instead of registers. Departures from the official CUDA kernel are
pallas.py's: time is sequential per program (no block-wide parallel scan), softplus and the SiLU
gate are left to XLA, no atomics. Padding (T to the chunk, Dm to the channel block, N to 8) uses
Δ = 0, x = B = C = 0, A = 0 and keep = 1: decay 1 and input 0, so padded steps and channels leave
the state unchanged.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float

from kernels.pallas_blocks import col_of
from kernels.selective_scan.pallas import scan_vjp
from kernels.x64 import fori_loop, iota

f32 = jnp.float32
G = 8  # tokens per aligned group (the sublane count of a float32 tile)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tokens per chunk (block_t: the time block of every BlockSpec and the saved-state interval)
    and channels per program (block_d), multiples of 8. Compiled for TPU, block_d must also be a
    multiple of 128 unless it covers Dm, and block_t unless it covers T (checked in the wrapper)."""

    # 128 tokens: a (N, 128) tile of B or C is one lane-wide vreg row, and 128 saved states per
    # (T, Dm, N) cost an eighth of x at N = 16. 256 channels: the per-token fixed costs (loop step,
    # picking the B_t, C_t columns) are shared by 4 vregs of state at N = 16, while the backward's
    # (128, N, 256) float32 scratch (2 MiB at N = 16, 8 MiB at N = 64; a larger N wants a smaller
    # block_d) and the double-buffered tiles stay under the 16 MiB default scoped VMEM of v5e.
    # Not tuned on a TPU.
    block_t: int = 128
    block_d: int = 256

    def __post_init__(self):
        for name in ("block_t", "block_d"):
            b = getattr(self, name)
            if b < G or b % G:
                raise ValueError(f"BlockSizes.{name}={b} must be a positive multiple of {G}")


@dataclasses.dataclass(frozen=True)
class _Config:
    block_t: int
    block_d: int
    interpret: bool


def _decay(dt, A, keep, t):
    """a_t = exp(Δ_t A) * keep_t, (N, bd) from Δ_t (1, bd), A (N, bd), keep (1, L)."""
    return jnp.exp(dt * A) * col_of(keep, t)


def _put_row(tile, s, row):
    """tile (G, C) with row s (static) replaced by row (1, C)."""
    return jnp.where(iota(tile.shape, 0) == s, row, tile)


def _chunk_inputs(A_ref, B_ref, C_ref, D_ref, keep_ref):
    # (N, bd), (N, L), (N, L), (1, bd), (1, L)
    return A_ref[...], B_ref[...], C_ref[...], D_ref[...], keep_ref[...]


def _rows(g):
    return pl.ds(pl.multiple_of(g * G, G), G)


def _fwd_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, keep_ref, h0_ref, y_ref, hT_ref, *rest):
    *hs_ref, h_scr = rest
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        h_scr[...] = h0_ref[...]

    if hs_ref:
        hs_ref[0][...] = h_scr[...]  # the state entering this chunk, for the backward
    A, Bt, Ct, D, keep = _chunk_inputs(A_ref, B_ref, C_ref, D_ref, keep_ref)

    def group(g, h):  # h (N, bd)
        rows = _rows(g)
        xs, dts = x_ref[rows, :], dt_ref[rows, :]  # (G, bd)
        ys = jnp.zeros(xs.shape, f32)
        for s in range(G):
            t = g * G + s
            x, dt = xs[s:s + 1], dts[s:s + 1]  # (1, bd)
            h = _decay(dt, A, keep, t) * h + col_of(Bt, t) * (dt * x)
            ys = _put_row(ys, s, jnp.sum(col_of(Ct, t) * h, axis=0, keepdims=True) + D * x)
        y_ref[rows, :] = ys
        return h

    h_scr[...] = fori_loop(0, x_ref.shape[0] // G, group, h_scr[...])

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = h_scr[...]


def _bwd_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, keep_ref, hs_ref, dy_ref, dhT_ref,
                dx_ref, ddt_ref, dB_ref, dC_ref, dA_ref, dD_ref, dh0_ref, hbuf, dh_scr):
    n, groups = pl.program_id(2), x_ref.shape[0] // G

    @pl.when(n == 0)  # the last chunk of the sequence
    def _():
        dh_scr[...] = dhT_ref[...]
        dA_ref[...] = jnp.zeros(dA_ref.shape, f32)
        dD_ref[...] = jnp.zeros(dD_ref.shape, f32)

    A, Bt, Ct, D, keep = _chunk_inputs(A_ref, B_ref, C_ref, D_ref, keep_ref)

    def recompute(g, h):  # hbuf[t] = the state before token t of the chunk
        rows = _rows(g)
        xs, dts = x_ref[rows, :], dt_ref[rows, :]
        for s in range(G):
            t = g * G + s
            hbuf[t] = h
            dt = dts[s:s + 1]
            h = _decay(dt, A, keep, t) * h + col_of(Bt, t) * (dt * xs[s:s + 1])
        return h

    fori_loop(0, groups, recompute, hs_ref[...])

    def group(i, carry):
        dh, dA, dD, dBt, dCt = carry  # (N, bd), (N, bd), (1, bd), (N, L), (N, L)
        g = groups - 1 - i
        rows = _rows(g)
        xs, dts, dys = x_ref[rows, :], dt_ref[rows, :], dy_ref[rows, :]  # (G, bd)
        dxs, ddts = jnp.zeros(xs.shape, f32), jnp.zeros(xs.shape, f32)
        for s in reversed(range(G)):
            t = g * G + s
            x, dt, dy = xs[s:s + 1], dts[s:s + 1], dys[s:s + 1]  # (1, bd)
            a, h_prev, Bc, u = _decay(dt, A, keep, t), hbuf[t], col_of(Bt, t), dt * x
            h = a * h_prev + Bc * u
            dh = dh + col_of(Ct, t) * dy  # dL/dh_t
            lane = iota(dBt.shape, 1) == t
            dCt = jnp.where(lane, jnp.sum(dy * h, axis=1, keepdims=True), dCt)
            dBt = jnp.where(lane, jnp.sum(dh * u, axis=1, keepdims=True), dBt)
            dh_B = jnp.sum(dh * Bc, axis=0, keepdims=True)  # (1, bd)
            w = dh * a * h_prev  # dL/d(Δ_t A) through the decay
            dxs = _put_row(dxs, s, dt * dh_B + D * dy)
            ddts = _put_row(ddts, s, x * dh_B + jnp.sum(w * A, axis=0, keepdims=True))
            dA, dD, dh = dA + w * dt, dD + dy * x, a * dh
        dx_ref[rows, :], ddt_ref[rows, :] = dxs, ddts
        return dh, dA, dD, dBt, dCt

    zeros_nl = jnp.zeros(Bt.shape, f32)
    dh, dA, dD, dBt, dCt = fori_loop(
        0, groups, group, (dh_scr[...], dA_ref[...], dD_ref[...], zeros_nl, zeros_nl))
    dh_scr[...], dA_ref[...], dD_ref[...], dB_ref[...], dC_ref[...] = dh, dA, dD, dBt, dCt

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = dh


class _Specs:
    """BlockSpecs over the grid (b, j, n); `rev` walks the chunks backwards."""

    def __init__(self, cfg, x, A, rev):
        Bsz, Tp, Dp = x.shape
        L, bd, Np = cfg.block_t, cfg.block_d, A.shape[0]
        nc = Tp // L
        c = (lambda n: nc - 1 - n) if rev else (lambda n: n)
        self.grid = (Bsz, Dp // bd, nc)
        self.td = pl.BlockSpec((None, L, bd), lambda b, j, n: (b, c(n), j))  # x, dt, y, dy, dx, ddt
        self.nd = pl.BlockSpec((Np, bd), lambda b, j, n: (0, j))  # A
        self.nt = pl.BlockSpec((None, Np, L), lambda b, j, n: (b, 0, c(n)))  # B, C (transposed)
        self.d = pl.BlockSpec((1, bd), lambda b, j, n: (0, j))  # D
        self.k = pl.BlockSpec((None, 1, L), lambda b, j, n: (b, 0, c(n)))  # keep
        self.h = pl.BlockSpec((None, Np, bd), lambda b, j, n: (b, 0, j))  # states, dA
        self.hs = pl.BlockSpec((None, None, Np, bd), lambda b, j, n: (b, c(n), 0, j))  # chunk states
        self.part = pl.BlockSpec((None, None, Np, L), lambda b, j, n: (j, b, 0, c(n)))  # dB, dC partials
        self.bd = pl.BlockSpec((None, 1, bd), lambda b, j, n: (b, 0, j))  # dD per batch row


def _call(kernel, cfg, s, in_specs, out_specs, out_shape, scratch, name, *args):
    return pl.pallas_call(
        kernel, grid=s.grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=scratch, name=name,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if cfg.interpret else False,
    )(*args)


def _forward(x, dt, A, B, C, D, keep, h0, cfg, save):
    s = _Specs(cfg, x, A, rev=False)
    Bsz, nc = x.shape[0], s.grid[2]
    out_specs = [s.td, s.h] + ([s.hs] if save else [])
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(h0.shape, f32)]
    if save:
        out_shape.append(jax.ShapeDtypeStruct((Bsz, nc, *A.shape), f32))
    return _call(_fwd_kernel, cfg, s, [s.td, s.td, s.nd, s.nt, s.nt, s.d, s.k, s.h], out_specs, out_shape,
                 [pltpu.VMEM((A.shape[0], cfg.block_d), f32)], "selective_scan_fwd_tpu",
                 x, dt, A, B, C, D, keep, h0)


def _backward(cfg, res, cts):
    x, dt, A, B, C, D, keep, hs = res
    dy, dhT = cts
    s = _Specs(cfg, x, A, rev=True)
    Bsz, nblocks, _ = s.grid
    Np, Tp = B.shape[1:]
    part = jax.ShapeDtypeStruct((nblocks, Bsz, Np, Tp), f32)
    dx, ddt, dB, dC, dA, dD, dh0 = _call(
        _bwd_kernel, cfg, s, [s.td, s.td, s.nd, s.nt, s.nt, s.d, s.k, s.hs, s.td, s.h],
        [s.td, s.td, s.part, s.part, s.h, s.bd, s.h],
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(dt.shape, dt.dtype), part, part,
         jax.ShapeDtypeStruct((Bsz, *A.shape), f32), jax.ShapeDtypeStruct((Bsz, *D.shape), f32),
         jax.ShapeDtypeStruct(dhT.shape, f32)],
        [pltpu.VMEM((cfg.block_t, Np, cfg.block_d), f32), pltpu.VMEM((Np, cfg.block_d), f32)],
        "selective_scan_bwd_tpu", x, dt, A, B, C, D, keep, hs, dy, dhT)
    return dx, ddt, dA.sum(0), dB.sum(0), dC.sum(0), dD.sum(0), None, dh0


_scan = scan_vjp(_forward, _backward)


def _round_up(n, m):
    return -(-n // m) * m


def selective_scan_pallas_tpu(x: Float[Array, "B T Dm"], delta: Float[Array, "B T Dm"],
                              A: Float[Array, "Dm N"], B: Float[Array, "B T N"], C: Float[Array, "B T N"],
                              D: Float[Array, " Dm"] | None, starts: Bool[Array, "B T"],
                              h0: Float[Array, "B Dm N"], *, block_sizes: BlockSizes | None = None,
                              interpret: bool | None = None):
    """Same function as selective_scan_recurrent, differentiable in every float input. Returns
    (y (B, T, Dm) in x's dtype, final state (B, Dm, N) float32). interpret=None: the TPU interpreter
    everywhere but on a TPU."""
    T, Dm, N = x.shape[1], x.shape[2], A.shape[1]
    blocks = block_sizes or BlockSizes()
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    L = blocks.block_t if T > blocks.block_t else _round_up(T, G)  # one chunk covers a short T
    bd = min(blocks.block_d, Dm)
    Tp, Dp, Np = _round_up(T, L), _round_up(Dm, bd), _round_up(N, G)
    if not interpret and ((L % 128 and L != Tp) or (bd % 128 and bd != Dp)):
        raise ValueError(f"selective_scan_pallas_tpu: block_t={L} and block_d={bd} must be multiples of "
                         f"128 (or cover T={T} / Dm={Dm}) to compile for TPU")
    cfg = _Config(block_t=L, block_d=bd, interpret=interpret)
    # Kernel layouts, padded to (Tp, Dp, Np):
    td = lambda a: jnp.pad(a.astype(f32), ((0, 0), (0, Tp - T), (0, Dp - Dm)))  # (B, T, Dm)
    nt = lambda a: jnp.pad(a.astype(f32), ((0, 0), (0, Tp - T), (0, Np - N))).transpose(0, 2, 1)  # (B, N, T)
    D = jnp.zeros((Dm,), f32) if D is None else D.astype(f32)
    keep = jnp.pad(1.0 - starts.astype(f32), ((0, 0), (0, Tp - T)), constant_values=1.0)[:, None]  # (B, 1, T)
    h0 = jnp.pad(h0.astype(f32), ((0, 0), (0, Dp - Dm), (0, Np - N))).transpose(0, 2, 1)  # (B, N, Dm)
    y, h = _scan(td(x), td(delta), jnp.pad(A.astype(f32), ((0, Dp - Dm), (0, Np - N))).T, nt(B), nt(C),
                 jnp.pad(D, (0, Dp - Dm))[None], keep, h0, cfg)
    return y[:, :T, :Dm].astype(x.dtype), h.transpose(0, 2, 1)[:, :Dm, :N]
