"""Mamba-3's SSM, single-input single-output (Lahoti et al., 2026): the exponential-trapezoidal
recurrence with a complex (rotary) state,

    h_t = α_t h_{t-1} + β_t x_{t-1} B̄_{t-1}^T + γ_t x_t B̄_t^T,    y_t = h_t C̄_t + D x_t

with B̄, C̄ = B, C rotated by the cumulative angles Θ_t = Σ Δ θ (reference.py gives every symbol).
x (B, T, H, P), dt = Δ (B, T, H) already positive, A (B, T, H) negative, lam = λ (B, T, H) in [0, 1],
B, C (B, T, H, N) per head (the caller adds the heads' biases to its groups), theta (B, T, H, N/2)
angle rates (zero for the channels left unrotated), D (H,); the carried state is a `Mamba3Carry`
(h (B, H, P, N), Θ (B, H, N/2), B̄_{t-1} (B, H, N), x_{t-1} (B, H, P)), float32.

Forms, all exact and computing the same function and final state:
- "recurrent": token-by-token lax.scan (reference.py, the truth);
- "chunk", "parallel": the recurrence rewritten exactly as linear attention with a scalar decay per
  head and token (trapezoid.py), in its chunked SSD form (chunk.py) or its quadratic form (parallel.py).

Mamba-2's SSD op (kernels/ssd) is not called: its decay exp(Δ A) and its input weight Δ come from one
Δ and one A per head, while here A_t varies per token and the input weight is the trapezoid's γ + ν
(trapezoid.py); writing one through the other would divide by Δ A, which is as small as Δ A_floor.
chunk.py and parallel.py are SSD's two forms with the decay and the input given apart.

`mamba3_mimo` is the MIMO variant (reference.py's `mamba3_mimo_step`): B, C (B, T, H, Mr, N) with a
rank axis, x_proj (H, Mr, P) lifting x to Mr inputs, Mr outputs (B, T, H, Mr, P) returned for the
caller to mix; its carry's B̄_{t-1} is (B, H, Mr, N). Its forms: the same scan, and mimo.py's rewrite
of each token as Mr steps of the same scalar-decay linear attention (chunk, parallel, pallas).

impl: "xla" runs the form picked by `mode`; "reference" the token-by-token scan whatever the mode;
"pallas" the rewrite on GLA's Pallas kernels in their scalar-gate mode (Triton on GPU, Mosaic on
TPU, interpret mode on CPU, slow and meant for tests), whose chunk is their own block size; "auto"
the kernels on GPU/TPU when kernels.AUTO_PALLAS is set and kernels.gla.pallas.supports() the call; on CPU,
in "chunk" mode, the chunked form through kernels/ssd's C++ kernels (one device); the XLA form elsewhere.

Under a mesh whose context axis splits the call (kernels/context.py), both ops run split along time
(split.py), each device's span in the form above.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, use_pallas
from kernels.gla.pallas import supports
from kernels.mamba3.mimo import mamba3_mimo_rewrite
from kernels.mamba3.reference import (
    Mamba3Carry,
    mamba3_mimo_recurrent,
    mamba3_mimo_step,
    mamba3_recurrent,
    mamba3_step,
    zero_carry,
)
from kernels.mamba3.split import mamba3_split
from kernels.mamba3.trapezoid import mamba3_trapezoid
from kernels.segments import document_starts
from kernels.ssd import cpu as ssd_cpu


def _form(mode: str, impl: str) -> str:
    """The XLA-side form: the chunked one through kernels/ssd's CPU kernels where "auto" finds them."""
    return "cpu" if mode == "chunk" and impl == "auto" and ssd_cpu.supports() else mode


def mamba3(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
           lam: Float[Array, "B T H"], B: Float[Array, "B T H N"], C: Float[Array, "B T H N"],
           theta: Float[Array, "B T H N//2"], D: Float[Array, " H"] | None = None, *,
           segment_ids: Int[Array, "B T"] | None = None, initial_state: Mamba3Carry | None = None,
           output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (y (B, T, H, P) in x's dtype, the final Mamba3Carry (float32) or None).

    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero, the previous-token term and the angles included (kernels/__init__.py)."""
    check_mode(mode, chunk_size, "mamba3")
    check_impl(impl, "mamba3")
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    if (any(a.shape != (Bsz, T, H) for a in (dt, A, lam)) or B.shape != (Bsz, T, H, N) or C.shape != B.shape
            or N % 2 or theta.shape != (Bsz, T, H, N // 2)):
        raise ValueError(f"mamba3: expected x (B, T, H, P), dt, A, lam (B, T, H), B, C (B, T, H, N) with N even and "
                         f"theta (B, T, H, N/2); got x {x.shape}, dt {dt.shape}, A {A.shape}, lam {lam.shape}, "
                         f"B {B.shape}, C {C.shape}, theta {theta.shape}")
    f32 = jnp.float32
    starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
    carry = zero_carry(Bsz, H, P, N) if initial_state is None else Mamba3Carry(*(a.astype(f32) for a in initial_state))
    args = [a.astype(f32) for a in (x, dt, A, lam, B, C, theta)] + [None if D is None else D.astype(f32)]
    if context.active(T):
        run = lambda *a, **kw: mamba3(*a, mode=mode, chunk_size=chunk_size, impl=impl, output_final_state=True, **kw)
        y, carry = mamba3_split(run, args[:7], [a for a in args[7:] if a is not None], segment_ids=segment_ids,
                                carry=carry)
    elif use_pallas(impl, supports(C, B, x)):
        y, carry = mamba3_trapezoid(*args, starts, segment_ids, carry, "pallas", chunk_size)
    elif impl == "reference" or mode == "recurrent":
        y, carry = mamba3_recurrent(*args, starts, carry)
    else:
        y, carry = mamba3_trapezoid(*args, starts, segment_ids, carry, _form(mode, impl), chunk_size)
    return y.astype(x.dtype), (carry if output_final_state else None)


def mamba3_mimo(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
                lam: Float[Array, "B T H"], B: Float[Array, "B T H Mr N"], C: Float[Array, "B T H Mr N"],
                theta: Float[Array, "B T H N//2"], x_proj: Float[Array, "H Mr P"], D: Float[Array, " H"] | None = None,
                *, segment_ids: Int[Array, "B T"] | None = None, initial_state: Mamba3Carry | None = None,
                output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (Y (B, T, H, Mr, P) in x's dtype, the final Mamba3Carry (float32, b (B, H, Mr, N)) or None);
    arguments as `mamba3`'s, chunk_size in tokens (a chunk holds chunk_size * Mr rank steps)."""
    check_mode(mode, chunk_size, "mamba3_mimo")
    check_impl(impl, "mamba3_mimo")
    Bsz, T, H, P = x.shape
    R, N = B.shape[-2:]
    if (any(a.shape != (Bsz, T, H) for a in (dt, A, lam)) or B.shape != (Bsz, T, H, R, N) or C.shape != B.shape
            or N % 2 or theta.shape != (Bsz, T, H, N // 2) or x_proj.shape != (H, R, P)):
        raise ValueError(f"mamba3_mimo: expected x (B, T, H, P), dt, A, lam (B, T, H), B, C (B, T, H, Mr, N) with N "
                         f"even, theta (B, T, H, N/2) and x_proj (H, Mr, P); got x {x.shape}, dt {dt.shape}, A "
                         f"{A.shape}, lam {lam.shape}, B {B.shape}, C {C.shape}, theta {theta.shape}, x_proj "
                         f"{x_proj.shape}")
    f32 = jnp.float32
    starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
    carry = (zero_carry(Bsz, H, P, N, R) if initial_state is None
             else Mamba3Carry(*(a.astype(f32) for a in initial_state)))
    args = [a.astype(f32) for a in (x, dt, A, lam, B, C, theta, x_proj)] + [None if D is None else D.astype(f32)]
    q = C.reshape(Bsz, T * R, H, N)  # (B, T R, H, N): the rank steps' shape, for supports()
    if context.active(T):
        run = lambda *a, **kw: mamba3_mimo(*a, mode=mode, chunk_size=chunk_size, impl=impl, output_final_state=True,
                                           **kw)
        y, carry = mamba3_split(run, args[:7], [a for a in args[7:] if a is not None], segment_ids=segment_ids,
                                carry=carry)
    elif use_pallas(impl, supports(q, q, x)):
        y, carry = mamba3_mimo_rewrite(*args, starts, segment_ids, carry, "pallas", chunk_size)
    elif impl == "reference" or mode == "recurrent":
        y, carry = mamba3_mimo_recurrent(*args, starts, carry)
    else:
        y, carry = mamba3_mimo_rewrite(*args, starts, segment_ids, carry, _form(mode, impl), chunk_size)
    return y.astype(x.dtype), (carry if output_final_state else None)


__all__ = ["Mamba3Carry", "mamba3", "mamba3_mimo", "mamba3_mimo_step", "mamba3_step", "zero_carry"]
