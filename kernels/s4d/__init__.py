"""S4D (Gu, Gupta, Goel & Ré 2022): a diagonal linear time-invariant SSM per channel, ZOH-discretised,

    h_t = Ā ⊙ h_{t-1} + B̄ u_t,   y_t = 2 Re(C h_t) + D u_t,   Ā = exp(Δ A), B̄ = (Ā - 1) / A

(reference.py for the symbols). Layout: channels, as the selective scan: u (B, T, Dm), one SSM of N
complex modes (the paper's state size 2N, conjugate pairs) per channel; the state is (B, Dm, N)
complex64.

Modes, both exact and computing the same function and final state:
- "recurrent": the token-by-token scan (reference.py), T sequential steps of O(Dm N);
- "fft": the SSM's kernel K = (C B̄ Ā^k)_k by Vandermonde products, applied by FFT, O(T log T) per
  channel, plus the initial state's contribution and the final state in closed form (fft.py).

Packed documents (`segment_ids`): a convolution cannot restart mid-sequence, so with segment_ids
every mode runs the recurrence, which zeroes the state at each document start (kernels/__init__.py):
exact, and O(T Dm N) work in T sequential steps. impl: "reference" the recurrence whatever the mode;
"xla"/"auto" the mode's form; no Pallas kernel ("pallas" is refused).

Under a mesh whose context axis splits the call (kernels/context.py), the op runs split along time
(`context.split_diagonal`), each device's span in the form above (both start from a state and give the
end state): h decays by M = Ā^L = exp(L Δ A) over a span of L tokens.
"""

import jax.numpy as jnp
from jaxtyping import Array, Complex, Float, Int

from kernels import check_mode, check_no_pallas, context
from kernels.s4d.fft import s4d_fft
from kernels.s4d.reference import discretize, s4d_recurrent, s4d_step
from kernels.segments import document_starts

MODES = ("recurrent", "fft")


def s4d(u: Float[Array, "B T Dm"], A: Complex[Array, "Dm N"], dt: Float[Array, " Dm"], C: Complex[Array, "Dm N"],
        D: Float[Array, " Dm"] | None = None, *, segment_ids: Int[Array, "B T"] | None = None,
        initial_state: Complex[Array, "B Dm N"] | None = None, output_final_state: bool = False,
        mode: str = "fft", impl: str = "auto"):
    """Returns (y (B, T, Dm) in u's dtype, final state (B, Dm, N) complex64 or None).

    A (Dm, N) complex with negative real parts, dt = Δ (Dm,) > 0, C (Dm, N) complex, D (Dm,) the skip.
    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py)."""
    check_mode(mode, 1, "s4d", MODES)
    check_no_pallas(impl, "s4d")
    Bsz, T, Dm = u.shape
    N = A.shape[-1]
    if A.shape != (Dm, N) or C.shape != (Dm, N) or dt.shape != (Dm,) or D is not None and D.shape != (Dm,):
        raise ValueError(f"s4d: expected u (B, T, Dm), A and C (Dm, N), dt and D (Dm,); got u {u.shape}, A {A.shape}, "
                         f"C {C.shape}, dt {dt.shape}, D {None if D is None else D.shape}")
    if context.active(T):
        run = lambda u, A, dt, C, *D, **kw: s4d(u, A, dt, C, *D, output_final_state=True, mode=mode, impl=impl, **kw)
        decay = lambda u, A, dt, C, *D: jnp.exp(u.shape[1] * dt.astype(jnp.float32)[:, None]
                                                * A.astype(jnp.complex64))  # (Dm, N)
        y, h = context.split_diagonal(run, (u,), (A, dt, C) + (() if D is None else (D,)), decay=decay,
                                      segment_ids=segment_ids, initial_state=initial_state)
        return y, (h if output_final_state else None)
    if impl == "reference" or mode == "recurrent" or segment_ids is not None:
        h0 = jnp.zeros((Bsz, Dm, N), jnp.complex64) if initial_state is None else initial_state
        starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
        y, h = s4d_recurrent(u, A, dt, C, D, starts, h0)
    else:
        y, h = s4d_fft(u, A, dt, C, D, initial_state, output_final_state)
    return y.astype(u.dtype), (h if output_final_state else None)


__all__ = ["MODES", "discretize", "s4d", "s4d_step"]
