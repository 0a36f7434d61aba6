"""Selective scan of Mamba-1 in Pallas (Gu & Dao, 2023, arXiv:2312.00752, Algorithm 2 and the
hardware-aware scan of Section 3.3.2), forward and backward:

    h_t = a_t ⊙ h_{t-1} + (Δ_t x_t) B_t,   a_t = exp(Δ_t A) (0 at a document start)
    y_t = C_t h_t + D x_t

One program per (block of channels, batch row) keeps its (channels, N) slice of h on chip for the
whole sequence; h is never written per step. The sequence runs in chunks of L tokens; the forward
writes the state entering each chunk (one (Dm, N) float32 state per L tokens, as many bytes as x in
float32 for L = N) when a gradient is wanted, and the chunk's tokens run as L unrolled steps, so
that their loads need not wait on the recurrence.

Backward (the same grid, chunks in reverse): from the saved state entering the chunk, the chunk's
L states are recomputed into registers (the unrolled steps make each its own value, which a loop
could not index), then the chunk runs backward with dh_t = C_t dy_t + a_{t+1} dh_{t+1}:

    dx_t = Δ_t (dh_t · B_t) + D dy_t          dB_t = Σ_d dh_t Δ_t x_t      dC_t = Σ_d dy_t h_t
    dΔ_t = x_t (dh_t · B_t) + Σ_n w_t A        dA = Σ_t w_t Δ_t             w_t = dh_t ⊙ a_t ⊙ h_{t-1}
    dD = Σ_t dy_t x_t                          d(initial state) = a_0 ⊙ dh_0

dh starts from the final state's cotangent. A document start has a_t = 0, so nothing crosses it in
either direction and w_t = 0 there (the decay is a constant, not exp(Δ A)).

Code names: x -> x (u in the official code), dt -> Δ, A, B, C, D as in reference.py; h the state
(B, Dm, N) float32.

Backend: Triton on GPU, as kernels/attention/pallas.py explains (this grid + BlockSpec kernel in
plain jnp does not lower to Mosaic GPU in jax 0.10.2; it runs unchanged in interpret mode on CPU,
where the tests check it). The kernel needs no matmul, so Triton's only constraint here is
power-of-two tiles. Without a GPU, a test checks that both kernels lower to Triton IR; that Triton
compiles and runs them is checked only by the tests marked gpu, not yet run. The TPU kernels
are in pallas_tpu.py.

Departures from the official CUDA kernel (selective_scan_fwd/bwd): it splits time across the
threads of a block (a block-wide parallel scan over 2048-token chunks) and one block per (batch,
channel); here time is sequential inside a program and the parallelism is over batch, channels and
the N state entries. It fuses softplus(Δ + bias) and the SiLU(z) gate; here XLA does (see
__init__.py). It accumulates dB, dC, dA and dD with atomics; here each program writes its partial
sums (dB, dC per channel block, dA, dD per batch row) and XLA adds them, which keeps the backward
deterministic. Padding (T to the chunk, Dm to the channel block, N to a power of two) uses Δ = 0,
x = B = C = 0, A = 0: decay 1 and input 0, so padded steps and channels leave the state unchanged.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float

from kernels import pallas_launch as launch
from kernels.pallas_blocks import check_blocks
from kernels.x64 import fori_loop

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tokens per chunk (block_t: saved-state interval and unrolled steps) and channels per program
    (block_d), powers of two, and GPU launch knobs."""

    block_t: int = 16
    block_d: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_blocks(self, ("block_t", "block_d"), 1)


BLOCK_SIZES = {
    # Not tuned (no GPU measurement yet): 16 unrolled steps of a (32, N) state keep the backward's
    # 17 recomputed states in registers at N = 16 (about 70 per thread with 4 warps).
    "gpu": BlockSizes(block_t=16, block_d=32),
    # Interpret mode (CPU): fewer unrolled steps compile faster.
    "cpu": BlockSizes(block_t=8, block_d=64),
}


def default_block_sizes(backend: str | None = None) -> BlockSizes:
    return launch.block_sizes_for(BLOCK_SIZES, backend)


def supports(x, A) -> bool:
    """Whether impl="auto" runs the kernel on GPU: float dtypes, N <= 16 (Mamba's d_state; the
    backward's recomputed states live in registers, so a larger N wants a smaller block_d), more
    than 16 tokens. A heuristic, not measured."""
    return (x.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) and A.shape[1] <= 16
            and x.shape[1] > 16)


@dataclasses.dataclass(frozen=True)
class _Config:
    block_t: int
    block_d: int
    num_warps: int
    num_stages: int
    interpret: bool


def _row(ref, t):
    return ref[t, :].astype(f32)


def _fwd_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, keep_ref, h0_ref, y_ref, hT_ref, *hs_ref, cfg):
    A, D, L = A_ref[...], D_ref[...], cfg.block_t  # (bd, N), (bd,)

    def chunk(c, h):  # h (bd, N)
        if hs_ref:
            hs_ref[0][c] = h  # the state entering chunk c, for the backward
        for s in range(L):
            t = c * L + s
            x, dt = _row(x_ref, t), _row(dt_ref, t)  # (bd,)
            h = jnp.exp(dt[:, None] * A) * keep_ref[t] * h + (dt * x)[:, None] * _row(B_ref, t)[None, :]
            y_ref[t, :] = (jnp.sum(h * _row(C_ref, t)[None, :], axis=1) + D * x).astype(y_ref.dtype)
        return h

    hT_ref[...] = fori_loop(0, x_ref.shape[0] // L, chunk, h0_ref[...])


def _bwd_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, keep_ref, hs_ref, dy_ref, dhT_ref,
                dx_ref, ddt_ref, dB_ref, dC_ref, dA_ref, dD_ref, dh0_ref, *, cfg):
    A, D, L = A_ref[...], D_ref[...], cfg.block_t
    num_chunks = x_ref.shape[0] // L

    def chunk(i, carry):
        dh, dA, dD = carry  # (bd, N), (bd, N), (bd,)
        c = num_chunks - 1 - i
        hs, rows = [hs_ref[c]], []  # hs[s]: the state before token s of the chunk
        decay = lambda t, dt: jnp.exp(dt[:, None] * A) * keep_ref[t]  # (bd, N)
        for s in range(L):
            t = c * L + s
            x, dt, B = _row(x_ref, t), _row(dt_ref, t), _row(B_ref, t)
            hs.append(decay(t, dt) * hs[-1] + (dt * x)[:, None] * B[None, :])
            rows.append((t, x, dt, B))
        for s in reversed(range(L)):  # the decays are recomputed: registers hold only the states
            t, x, dt, B = rows[s]
            a, dy = decay(t, dt), _row(dy_ref, t)
            dh = dh + dy[:, None] * _row(C_ref, t)[None, :]  # dL/dh_t
            dC_ref[t, :] = jnp.sum(dy[:, None] * hs[s + 1], axis=0)
            dB_ref[t, :] = jnp.sum(dh * (dt * x)[:, None], axis=0)
            dh_B = jnp.sum(dh * B[None, :], axis=1)  # (bd,)
            w = dh * a * hs[s]  # dL/d(Δ_t A) through the decay
            dx_ref[t, :] = (dt * dh_B + D * dy).astype(dx_ref.dtype)
            ddt_ref[t, :] = (x * dh_B + jnp.sum(w * A, axis=1)).astype(ddt_ref.dtype)
            dA, dD, dh = dA + w * dt[:, None], dD + dy * x, a * dh
        return dh, dA, dD

    init = (dhT_ref[...], jnp.zeros(A.shape, f32), jnp.zeros(D.shape, f32))
    dh0_ref[...], dA_ref[...], dD_ref[...] = fori_loop(0, num_chunks, chunk, init)


class _Specs:
    """BlockSpecs over the grid (channel block j, batch row b)."""

    def __init__(self, cfg, x, A):
        Bsz, Tp, Dm = x.shape
        bd, N = cfg.block_d, A.shape[1]
        self.grid = (Dm // bd, Bsz)
        self.td = pl.BlockSpec((None, Tp, bd), lambda j, b: (b, 0, j))  # x, dt, y, dx, ddt
        self.dn = pl.BlockSpec((bd, N), lambda j, b: (j, 0))  # A
        self.tn = pl.BlockSpec((None, Tp, N), lambda j, b: (b, 0, 0))  # B, C
        self.d = pl.BlockSpec((bd,), lambda j, b: (j,))  # D
        self.t = pl.BlockSpec((None, Tp), lambda j, b: (b, 0))  # keep
        self.h = pl.BlockSpec((None, bd, N), lambda j, b: (b, j, 0))  # states, dA
        self.hs = pl.BlockSpec((None, Tp // cfg.block_t, bd, N), lambda j, b: (b, 0, j, 0))
        self.part = pl.BlockSpec((None, None, Tp, N), lambda j, b: (j, b, 0, 0))  # dB, dC per channel block
        self.bd = pl.BlockSpec((None, bd), lambda j, b: (b, j))  # dD per batch row


def _call(kernel, cfg, s, *specs_shapes_name_args):
    return launch.triton_call(functools.partial(kernel, cfg=cfg), cfg, s.grid, *specs_shapes_name_args)


def _forward(x, dt, A, B, C, D, keep, h0, cfg, save):
    s = _Specs(cfg, x, A)
    Bsz, Tp, Dm = x.shape
    out_specs = [s.td, s.h] + ([s.hs] if save else [])
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(h0.shape, f32)]
    if save:
        out_shape.append(jax.ShapeDtypeStruct((Bsz, Tp // cfg.block_t, Dm, A.shape[1]), f32))
    return _call(_fwd_kernel, cfg, s, [s.td, s.td, s.dn, s.tn, s.tn, s.d, s.t, s.h], out_specs, out_shape,
                 "selective_scan_fwd", x, dt, A, B, C, D, keep, h0)


def scan_vjp(forward, backward):
    """The differentiable call of a selective-scan kernel family (this file's GPU kernels and
    pallas_tpu.py's TPU ones): scan(x, dt, A, B, C, D, keep, h0, cfg) -> (y, final state), from
    forward(x, dt, A, B, C, D, keep, h0, cfg, save) -> (y, final state[, the state entering each chunk
    with save]) and backward(cfg, (x, dt, A, B, C, D, keep, chunk states), (dy, d final state)) -> the
    inputs' cotangents."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
    def scan(x, dt, A, B, C, D, keep, h0, cfg):
        return tuple(forward(x, dt, A, B, C, D, keep, h0, cfg, save=False))

    def scan_fwd(x, dt, A, B, C, D, keep, h0, cfg):
        y, hT, hs = forward(x, dt, A, B, C, D, keep, h0, cfg, save=True)
        return (y, hT), (x, dt, A, B, C, D, keep, hs)

    scan.defvjp(scan_fwd, backward)
    return scan


def _backward(cfg, res, cts):
    x, dt, A, B, C, D, keep, hs = res
    dy, dhT = cts
    s = _Specs(cfg, x, A)
    (Dblocks, Bsz), (Tp, N) = s.grid, B.shape[1:]
    part = jax.ShapeDtypeStruct((Dblocks, Bsz, Tp, N), f32)
    dx, ddt, dB, dC, dA, dD, dh0 = _call(
        _bwd_kernel, cfg, s, [s.td, s.td, s.dn, s.tn, s.tn, s.d, s.t, s.hs, s.td, s.h],
        [s.td, s.td, s.part, s.part, s.h, s.bd, s.h],
        [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(dt.shape, dt.dtype), part, part,
         jax.ShapeDtypeStruct((Bsz, *A.shape), f32), jax.ShapeDtypeStruct((Bsz, A.shape[0]), f32),
         jax.ShapeDtypeStruct(dhT.shape, f32)],
        "selective_scan_bwd", x, dt, A, B, C, D, keep, hs, dy.astype(x.dtype), dhT)
    return (dx, ddt, dA.sum(0).astype(A.dtype), dB.sum(0).astype(B.dtype), dC.sum(0).astype(C.dtype),
            dD.sum(0).astype(D.dtype), None, dh0)


_scan = scan_vjp(_forward, _backward)


def selective_scan_pallas(x: Float[Array, "B T Dm"], delta: Float[Array, "B T Dm"], A: Float[Array, "Dm N"],
                          B: Float[Array, "B T N"], C: Float[Array, "B T N"], D: Float[Array, " Dm"] | None,
                          starts: Bool[Array, "B T"], h0: Float[Array, "B Dm N"], *,
                          block_sizes: BlockSizes | None = None, interpret: bool | None = None):
    """Same function as selective_scan_recurrent, differentiable in every float input. Returns
    (y (B, T, Dm) in x's dtype, final state (B, Dm, N) float32). interpret=None: interpret mode
    everywhere but on GPU."""
    Bsz, T, Dm = x.shape
    N = A.shape[1]
    backend = jax.default_backend()
    blocks = block_sizes or default_block_sizes(backend)
    L, bd = min(blocks.block_t, pl.next_power_of_2(T)), min(blocks.block_d, pl.next_power_of_2(Dm))
    Tp, Dp, Np = -(-T // L) * L, -(-Dm // bd) * bd, pl.next_power_of_2(N)
    cfg = _Config(block_t=L, block_d=bd, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
                  interpret=backend != "gpu" if interpret is None else interpret)
    td = lambda a: jnp.pad(a, ((0, 0), (0, Tp - T), (0, Dp - Dm)))
    tn = lambda a: jnp.pad(a, ((0, 0), (0, Tp - T), (0, Np - N)))
    # A and D enter the kernels in float32, as every row they load does (jax differentiates the casts):
    # a float64 A (the default dtype under x64) would make the carried state float64.
    A, D = A.astype(f32), jnp.zeros((Dm,), f32) if D is None else D.astype(f32)
    keep = jnp.pad(1.0 - starts.astype(f32), ((0, 0), (0, Tp - T)), constant_values=1.0)
    y, h = _scan(td(x), td(delta), jnp.pad(A, ((0, Dp - Dm), (0, Np - N))), tn(B), tn(C),
                 jnp.pad(D, (0, Dp - Dm)), keep, jnp.pad(h0.astype(f32), ((0, 0), (0, Dp - Dm), (0, Np - N))),
                 cfg)
    return y[:, :T, :Dm], h[:, :Dm, :N]
