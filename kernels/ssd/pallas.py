"""SSD of Mamba-2 in Pallas (Dao & Gu, 2024, arXiv:2405.21060, the chunked algorithm of Section 6),
forward and backward, both as Pallas kernels.

SSD is gated linear attention with one log-decay per (token, head), so the kernels are those of
kernels/gla/pallas.py in their scalar-gate mode, under the renaming

    q <- C (B, T, G, N)    k <- B (B, T, G, N)    v <- Δ x (B, T, H, P)    g <- Δ A (B, T, H)
    S <- h^T (N, P)        scale 1                 head h reads group h // (H / G)

Per chunk of L tokens (cum_t = Σ_{r <= t in chunk} Δ_r A), one program per (block of P, batch row,
head) runs the paper's four steps fused, the state on chip:

    1. Y_diag = (L ∘ C B^T)(Δ x),  L[t, s] = exp(cum_t - cum_s) for s <= t (same document)
    2. chunk state S_c = Σ_s exp(cum_{L-1} - cum_s) Δ_s x_s B_s^T
    3. h_in(c+1) = exp(cum_{L-1}) h_in(c) + S_c        (carried in registers, never stored)
    4. Y_off = exp(cum_t) C_t h_in(c)
    y = Y_diag + Y_off + D x

The backward kernels (dC forward in time recomputing h_in; dB, d(Δx), d h_0 backward in time
carrying dh) are GLA's; dΔ and dA come through the renaming by XLA's chain rule from d(Δx) and
dg, where dg = Σ_{s >= t} (C_s · dC_s - B_s · dB_s) within the document (see kernels/gla/pallas.py).

Backend: Triton on GPU, for the reasons given in kernels/gla/pallas.py and
kernels/attention/pallas.py. Where kernels.pallas_platform() is "tpu" (on a TPU, or
ZOO_PALLAS_PLATFORM=tpu elsewhere) the same renaming runs the Mosaic TPU kernels of
kernels/gla/pallas_tpu.py instead: grid (batch row, head, block of P, chunk), h^T in a VMEM scratch
buffer carried across the sequential chunk axis; `block_sizes` is then that file's BlockSizes.

Departures from the official Triton kernels (mamba_chunk_scan_combined): they run the steps as five
kernels with the chunk states written to HBM (chunk_state, state_passing, chunk_scan) and fuse
softplus(Δ + bias); here one kernel carries the state across chunks sequentially per (batch, head)
and XLA forms Δ x and Δ A beforehand (Δ x is one extra pass over x). B and C are never repeated
across the heads of a group (the kernel indexes the group), but their gradients are summed over the
group's heads in XLA. The decay inside a chunk is a difference of cumulative sums, as in the
official kernels and chunk.py.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import pallas_platform
from kernels.gla.pallas import BlockSizes, gla_pallas
from kernels.gla.pallas_tpu import BlockSizes as TPUBlockSizes
from kernels.gla.pallas_tpu import gla_pallas_tpu

f32 = jnp.float32


def supports(x, B) -> bool:
    """Whether impl="auto" runs the kernel on GPU: float dtypes, P and N <= 256, more than 16
    tokens. A heuristic, not measured."""
    return (all(a.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) for a in (x, B))
            and max(x.shape[-1], B.shape[-1]) <= 256 and x.shape[1] > 16)


def ssd_pallas(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
               B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], D: Float[Array, " H"] | None = None, *,
               segment_ids: Int[Array, "B T"] | None = None,
               initial_state: Float[Array, "B H P N"] | None = None,
               block_sizes: BlockSizes | TPUBlockSizes | None = None, interpret: bool | None = None):
    """Same function as ssd_recurrent, differentiable in every float input. Returns (y (B, T, H, P)
    in x's dtype, final state (B, H, P, N) float32). Runs gla_pallas_tpu where
    kernels.pallas_platform() is "tpu", gla_pallas elsewhere."""
    v = (x.astype(f32) * dt.astype(f32)[..., None]).astype(x.dtype)  # Δ x
    g = dt.astype(f32) * A.astype(f32)  # Δ A (B, T, H)
    h0 = None if initial_state is None else jnp.swapaxes(initial_state, 2, 3)  # (B, H, N, P)
    kernel = gla_pallas_tpu if pallas_platform() == "tpu" else gla_pallas
    y, S = kernel(C, B, v, g, scale=1.0, segment_ids=segment_ids, initial_state=h0,
                      block_sizes=block_sizes, interpret=interpret)
    y = y.astype(f32)
    if D is not None:
        y = y + D.astype(f32)[:, None] * x.astype(f32)
    return y.astype(x.dtype), jnp.swapaxes(S, 2, 3)
