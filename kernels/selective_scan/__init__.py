"""Selective scan of Mamba-1 (Gu & Dao, 2023): the input-dependent diagonal SSM

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t,    y_t = C_t h_t + D x_t

Layout: channels, not heads. x and Δ are (B, T, Dm), one scalar SSM per channel d with its own row
A[d] of N decay rates; B_t, C_t (B, T, N) are shared by all channels; the state h is (B, Dm, N)
float32. Δ must already be positive: the caller applies softplus(Δ + bias) (the official
`selective_scan_fn` fuses this through `delta_bias`/`delta_softplus` and also fuses the SiLU(z)
gate; here XLA fuses both, so the op keeps to the SSM itself and the gate lives in layers/mamba.py).

Modes, all exact and all computing the same function and final state:
- "recurrent": token-by-token lax.scan, T sequential steps (recurrent.py: reference.py's scan, the
  truth, with a hand-written backward; impl="reference" differentiates the reference itself);
- "chunk": the scan inside chunks of `chunk_size`, all chunks at once, state carried across chunks
  (chunk.py), chunk_size sequential steps plus T / chunk_size;
- "parallel": lax.associative_scan over (decay, input) pairs (parallel.py), O(log T) depth.

mode="auto" (the default) picks the fastest exact form for the backend: "recurrent" on CPU, where
it was measured fastest at every size tried (jitted, float32, 2 shared cores, ms per call,
forward / forward+backward w.r.t. all inputs; chunk at its best chunk size):

    B, T, Dm, N        recurrent       chunk          parallel
    1, 512, 16, 4      0.13 / 0.76     0.29 / 0.89    0.21 / 3.6
    2, 512, 64, 16     1.3  / 10       2.6  / 21      5.5  / 30
    2, 256, 256, 16    3.4  / 35       8.2  / 71      31   / 87

On CPU the scan is compute-bound (about 1 ns per element and step, exp dominating) and a loop step
costs well under a microsecond, so the forms that trade extra work for fewer steps lose. Elsewhere
"auto" picks "chunk", on the reasoning that a device pays a fixed cost per loop step; that choice is
not measured yet.

impl: "xla" runs the form picked by `mode`; "reference" the token-by-token scan whatever the mode;
"pallas" the Pallas kernels of kernels.pallas_platform() (the state on chip, chunk-boundary states
saved for the backward): pallas.py (Triton) on GPU, pallas_tpu.py (Mosaic TPU) on TPU, interpret
mode on CPU, slow and meant for tests; "auto" the kernels on GPU/TPU when kernels.AUTO_PALLAS is set
(until verified there, see kernels/__init__.py) and pallas.supports() the call, the XLA form
elsewhere.

Under a mesh whose context axis splits the call (kernels/context.py), the op runs split along time
(`context.split_diagonal`), each device's span in the form above: h decays elementwise, by
M = exp(Σ_t Δ_t A) (B, Dm, N) over a span.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import MODES, check_impl, check_mode, context, pallas_platform, use_pallas
from kernels.segments import scan_inputs
from kernels.selective_scan.chunk import selective_scan_chunk
from kernels.selective_scan.pallas import selective_scan_pallas, supports
from kernels.selective_scan.pallas_tpu import selective_scan_pallas_tpu
from kernels.selective_scan.parallel import selective_scan_parallel
from kernels.selective_scan.recurrent import selective_scan_adjoint
from kernels.selective_scan.reference import selective_scan_recurrent, selective_scan_step


def selective_scan(x: Float[Array, "B T Dm"], delta: Float[Array, "B T Dm"], A: Float[Array, "Dm N"],
                   B: Float[Array, "B T N"], C: Float[Array, "B T N"], D: Float[Array, " Dm"] | None = None, *,
                   segment_ids: Int[Array, "B T"] | None = None,
                   initial_state: Float[Array, "B Dm N"] | None = None, output_final_state: bool = False,
                   mode: str = "auto", chunk_size: int = 64, impl: str = "auto"):
    """Returns (y (B, T, Dm) in x's dtype, final state (B, Dm, N) float32 or None).

    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py)."""
    check_mode(mode, chunk_size, "selective_scan", MODES + ("auto",))
    check_impl(impl, "selective_scan")
    Bsz, T, Dm = x.shape
    N = A.shape[1]
    if A.shape != (Dm, N) or delta.shape != x.shape or B.shape != (Bsz, T, N) or C.shape != (Bsz, T, N):
        raise ValueError(f"selective_scan: expected x, delta (B, T, Dm), A (Dm, N), B, C (B, T, N); got x "
                         f"{x.shape}, delta {delta.shape}, A {A.shape}, B {B.shape}, C {C.shape}")
    if context.active(T):
        run = lambda x, delta, B, C, A, *D, **kw: selective_scan(x, delta, A, B, C, *D, mode=mode, impl=impl,
                                                                chunk_size=chunk_size, output_final_state=True, **kw)
        decay = lambda x, delta, B, C, A, *D: jnp.exp(jnp.sum(delta.astype(jnp.float32), axis=1)[:, :, None]
                                                      * A.astype(jnp.float32))  # (B, Dm, N)
        y, h = context.split_diagonal(run, (x, delta, B, C), (A,) + (() if D is None else (D,)), decay=decay,
                                      segment_ids=segment_ids, initial_state=initial_state)
        return y, (h if output_final_state else None)
    args, starts, h0 = scan_inputs((x, delta, A, B, C), D, segment_ids, initial_state, (Bsz, Dm, N))
    if use_pallas(impl, supports(x, A)):  # the one dispatch point
        kernel = selective_scan_pallas_tpu if pallas_platform() == "tpu" else selective_scan_pallas
        y, h = kernel(x, delta, A, B, C, D, starts, h0)
        return y, (h if output_final_state else None)
    if mode == "auto":
        mode = "recurrent" if jax.default_backend() == "cpu" else "chunk"
    forms = {"recurrent": selective_scan_adjoint, "chunk": partial(selective_scan_chunk, chunk_size=chunk_size),
             "parallel": selective_scan_parallel}
    y, h = (selective_scan_recurrent if impl == "reference" else forms[mode])(*args, starts, h0)
    return y.astype(x.dtype), (h if output_final_state else None)


__all__ = ["selective_scan", "selective_scan_step"]
