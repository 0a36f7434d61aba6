"""SSD, the selective SSM of Mamba-2 (Dao & Gu, 2024): one scalar decay per head and step,

    h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t^T,    y_t = h_t C_t + D_h x_t

x (B, T, H, P), dt (B, T, H) already positive (the caller applies softplus(dt + dt_bias); the
official `mamba_chunk_scan_combined` fuses that through `dt_bias`/`dt_softplus`, XLA fuses it here),
A (H,) negative, B, C (B, T, G, N) with G dividing H (head h reads group h // (H / G)), D (H,);
state (B, H, P, N) float32.

Modes, all exact and computing the same function and final state:
- "recurrent": token-by-token lax.scan (reference.py, the truth);
- "chunk": the chunked SSD algorithm (chunk.py): quadratic inside chunks, states passed across;
- "parallel": the quadratic masked form over the whole sequence (parallel.py), O(T^2).

"chunk" is the default and the fastest form measured on CPU for training (jitted, float32, 2 shared
cores, B=2, T=512, H=4, P=N=16, forward + backward w.r.t. all inputs): chunk 32 about 2-5 ms,
chunk 64 about 6-7 ms, recurrent 20-35 ms, parallel about 210 ms.

impl: "xla" runs the form picked by `mode`; "reference" the token-by-token scan whatever the mode;
"pallas" the Pallas kernels (pallas.py: the chunked algorithm as GLA's kernels with a scalar gate,
forward and backward; Triton on GPU, Mosaic on TPU, interpret mode on CPU, slow and meant for
tests), whose chunk is their own block size, not `chunk_size`; "auto" the kernels on GPU/TPU when
kernels.AUTO_PALLAS is set and pallas.supports() the call; on CPU, in "chunk" mode, the chunked algorithm
through the C++ kernels of cpu.py (cpu.cc, compiled on first use; one device); the XLA form elsewhere.
"""

from functools import partial

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode, context, use_pallas
from kernels.segments import scan_inputs
from kernels.ssd import cpu
from kernels.ssd.chunk import ssd_chunk
from kernels.ssd.pallas import ssd_pallas, supports
from kernels.ssd.parallel import ssd_parallel
from kernels.ssd.reference import ssd_recurrent, ssd_step


def ssd(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"], B: Float[Array, "B T G N"],
        C: Float[Array, "B T G N"], D: Float[Array, " H"] | None = None, *,
        segment_ids: Int[Array, "B T"] | None = None, initial_state: Float[Array, "B H P N"] | None = None,
        output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (y (B, T, H, P) in x's dtype, final state (B, H, P, N) float32 or None).

    segment_ids / initial_state: token 0 continues initial_state (zero when None), every later document
    start restarts from zero (kernels/__init__.py)."""
    check_mode(mode, chunk_size, "ssd")
    check_impl(impl, "ssd")
    if context.active(x.shape[1]):
        run = lambda x, dt, B, C, A, *D, **kw: ssd(x, dt, A, B, C, *D, mode=mode, chunk_size=chunk_size, impl=impl,
                                                  output_final_state=True, **kw)
        decay = lambda x, dt, B, C, A, *D: jnp.exp(jnp.sum(dt * A, axis=1))[..., None, None]  # (B, H, 1, 1)
        o, state = context.split_diagonal(run, (x, dt, B, C), (A,) + (() if D is None else (D,)), decay=decay,
                                          segment_ids=segment_ids, initial_state=initial_state)
        return o, (state if output_final_state else None)
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    if (dt.shape != (Bsz, T, H) or A.shape != (H,) or B.shape != (Bsz, T, G, N) or C.shape != B.shape
            or H % G):
        raise ValueError(f"ssd: expected x (B, T, H, P), dt (B, T, H), A (H,), B, C (B, T, G, N) with G dividing "
                         f"H; got x {x.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, C {C.shape}")
    if use_pallas(impl, supports(x, B)):  # the one dispatch point
        y, h = ssd_pallas(x, dt, A, B, C, D, segment_ids=segment_ids, initial_state=initial_state)
        return y, (h if output_final_state else None)
    args, starts, h0 = scan_inputs((x, dt, A, B, C), D, segment_ids, initial_state, (Bsz, H, P, N))
    chunk = partial(ssd_chunk, chunk_size=chunk_size, cpu_kernels=impl == "auto" and cpu.supports())
    forms = {"recurrent": ssd_recurrent, "chunk": chunk, "parallel": ssd_parallel}
    y, h = forms["recurrent" if impl == "reference" else mode](*args, starts, h0)
    return y.astype(x.dtype), (h if output_final_state else None)


__all__ = ["ssd", "ssd_step"]
