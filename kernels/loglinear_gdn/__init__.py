"""Log-linear Gated DeltaNet (Guo et al., 2025, "Log-Linear Attention", arXiv:2506.04761): the gated delta rule
whose single state per head is a Fenwick tree of L states, each key weighted by the query's λ for its level,

    o_t = scale Σ_{s ≤ t} λ_t^(ℓ(t, s)) (q_t^T Φ(t, s) k_s) β_s v_s,    Φ(t, s) = Π_{s < r ≤ t} α_r (I - β_r k_r k_r^T)
    ℓ(t, s) = bit_length(t XOR s) on positions inside the document              (kernels/loglinear's levels)

(equations and symbols in reference.py). q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H), g = log α (B, T, H) or
None, lam (B, T, H, L); the state is (S (B, H, L, K, V) float32, n (B,) int32): the Fenwick states and the token
count of the current document, as kernels/loglinear's. With λ ≡ 1 this is kernels/delta_rule's op.

Modes, both exact and computing the same function and final state:
- "recurrent": token-by-token lax.scan of the Fenwick merges and the delta rule on every level (reference.py);
- "parallel": the delta rule's effective attention matrix from one triangular solve, times the level weights,
  times V (parallel.py), O(T^2).

No chunked O(T log T) form yet (the paper's chunkwise algorithm: the gated delta rule's chunk form within a chunk,
one inter-chunk pass per level above it), and no Pallas kernel: impl is "auto" (the form `mode` picks), "xla" (the
same) or "reference" (the token-by-token scan whatever the mode); "pallas" is refused.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.loglinear import MODES
from kernels.loglinear_gdn.parallel import loglinear_gdn_parallel
from kernels.loglinear_gdn.reference import loglinear_gdn_recurrent, loglinear_gdn_step, merge_levels
from kernels.segments import document_starts


def loglinear_gated_delta_rule(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                               beta: Float[Array, "B T H"], g: Float[Array, "B T H"] | None,
                               lam: Float[Array, "B T H L"], *, scale: float | None = None,
                               segment_ids: Int[Array, "B T"] | None = None,
                               initial_state: Float[Array, "B H L K V"] | None = None,
                               initial_count: Int[Array, " B"] | None = None, output_final_state: bool = False,
                               mode: str = "parallel", impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, (S (B, H, L, K, V) float32, n (B,) int32) or None). scale defaults to
    K^-1/2.

    initial_state / initial_count: the Fenwick states and the position in its document of token 0 (zeros when
    None); token 0 continues them whatever its segment id, every later document start restarts from zero
    (kernels/__init__.py)."""
    check_mode(mode, 1, "loglinear_gated_delta_rule", MODES)
    check_no_pallas(impl, "loglinear_gated_delta_rule")
    Bsz, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    if (k.shape != q.shape or v.shape != (Bsz, T, H, V) or beta.shape != (Bsz, T, H)
            or (g is not None and g.shape != (Bsz, T, H)) or lam.shape != (Bsz, T, H, L)):
        raise ValueError(f"loglinear_gated_delta_rule: expected q, k (B, T, H, K), v (B, T, H, V), beta and g "
                         f"(B, T, H), lam (B, T, H, L); got q {q.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}, "
                         f"g {None if g is None else g.shape}, lam {lam.shape}")
    f32 = jnp.float32
    scale = K ** -0.5 if scale is None else scale
    S0 = jnp.zeros((Bsz, H, L, K, V), f32) if initial_state is None else initial_state.astype(f32)
    n0 = jnp.zeros((Bsz,), jnp.int32) if initial_count is None else initial_count.astype(jnp.int32)
    args = [a.astype(f32) for a in (q, k, v, beta)] + [None if g is None else g.astype(f32), lam.astype(f32)]
    if impl == "reference" or mode == "recurrent":
        starts = jnp.zeros((Bsz, T), bool) if segment_ids is None else document_starts(segment_ids)
        o, S, n = loglinear_gdn_recurrent(*args, starts, S0, n0, scale=scale)
    else:
        o, S, n = loglinear_gdn_parallel(*args, segment_ids, S0, n0, scale=scale)
    return o.astype(q.dtype), ((S, n) if output_final_state else None)


__all__ = ["MODES", "loglinear_gated_delta_rule", "loglinear_gdn_step", "merge_levels"]
