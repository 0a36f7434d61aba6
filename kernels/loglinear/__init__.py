"""Log-linear Mamba-2 (Guo et al., 2025, "Log-Linear Attention", arXiv:2506.04761): SSD whose single state
per head is a Fenwick tree of L states, each key weighted by the query's λ for the key's level,

    y_t = Σ_{s ≤ t} λ_t^(ℓ(t, s)) exp(Σ_{s < r ≤ t} Δ_r A) (C_t · B_s) Δ_s x_s + D x_t,
    ℓ(t, s) = bit_length(t XOR s) on positions inside the document

(equations and symbols in reference.py). x (B, T, H, P), dt (B, T, H) already positive, A (H,) negative,
B, C (B, T, G, N) with G dividing H, lam (B, T, H, L) the level weights, D (H,); the state is
(S (B, H, L, P, N) float32, n (B,) int32): the Fenwick states and the token count of the current document.

Modes, both exact and computing the same function and final state:
- "recurrent": token-by-token lax.scan of the Fenwick merges (reference.py, the truth);
- "parallel": the quadratic masked form over the whole sequence (parallel.py), O(T^2).

No chunked form yet (the paper's chunkwise algorithm: Mamba-2's chunked SSD within a chunk, one
inter-chunk scan per level above it), and no Pallas kernel: impl is "auto" (the form `mode` picks),
"xla" (the same) or "reference" (the token-by-token scan whatever the mode); "pallas" is refused.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.loglinear.parallel import loglinear_parallel
from kernels.loglinear.reference import fenwick_level, loglinear_recurrent, loglinear_step
from kernels.segments import document_index, document_starts, positions_in_document

MODES = ("recurrent", "parallel")


def num_levels(length: int) -> int:
    """Levels a document of `length` tokens needs so that no key is capped: ceil(log2 length) + 1."""
    return max(int(length) - 1, 0).bit_length() + 1


def loglinear_ssd(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
                  B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], lam: Float[Array, "B T H L"],
                  D: Float[Array, " H"] | None = None, *, segment_ids: Int[Array, "B T"] | None = None,
                  initial_state: Float[Array, "B H L P N"] | None = None,
                  initial_count: Int[Array, " B"] | None = None, output_final_state: bool = False,
                  mode: str = "parallel", impl: str = "auto"):
    """Returns (y (B, T, H, P) in x's dtype, (S (B, H, L, P, N) float32, n (B,) int32) or None).

    initial_state / initial_count: the Fenwick states and the position in its document of token 0 (zeros when
    None); token 0 continues them whatever its segment id, every later document start restarts from zero
    (kernels/__init__.py)."""
    check_mode(mode, 1, "loglinear_ssd", MODES)
    check_no_pallas(impl, "loglinear_ssd")
    Bsz, T, H, P = x.shape
    G, N = B.shape[2:]
    L = lam.shape[-1]
    if (dt.shape != (Bsz, T, H) or A.shape != (H,) or B.shape != (Bsz, T, G, N) or C.shape != B.shape
            or lam.shape != (Bsz, T, H, L) or H % G):
        raise ValueError(f"loglinear_ssd: expected x (B, T, H, P), dt (B, T, H), A (H,), B, C (B, T, G, N) with G "
                         f"dividing H, lam (B, T, H, L); got x {x.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, "
                         f"C {C.shape}, lam {lam.shape}")
    f32 = jnp.float32
    S0 = jnp.zeros((Bsz, H, L, P, N), f32) if initial_state is None else initial_state.astype(f32)
    n0 = jnp.zeros((Bsz,), jnp.int32) if initial_count is None else initial_count.astype(jnp.int32)
    args = [a.astype(f32) for a in (x, dt, A, B, C, lam)] + [None if D is None else D.astype(f32)]
    if impl == "reference" or mode == "recurrent":
        starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
        y, S, n = loglinear_recurrent(*args, starts, S0, n0)
    else:
        doc = document_index(segment_ids, Bsz, T)
        pos = positions_in_document(segment_ids, Bsz, T, start=n0)
        y, S, n = loglinear_parallel(*args, doc, pos, S0, n0)
    return y.astype(x.dtype), ((S, n) if output_final_state else None)


__all__ = ["MODES", "fenwick_level", "loglinear_ssd", "loglinear_step", "num_levels"]
