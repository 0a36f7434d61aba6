"""Log-linear Gated DeltaNet in its quadratic masked form (Guo et al., 2025, "Log-Linear Attention",
Sections 2 and 4): the gated delta rule's effective attention matrix times the hierarchical mask.

Every level state is moved by the same transition (reference.py), so token s reaches query t through one
scalar, A_eff[t, s] = scale · q_t^T Φ(t, s) k_s β_s, weighted by λ_t at the key's level:

    o_t = Σ_s λ_t^(ℓ(t, s)) A_eff[t, s] v_s + Σ_j λ_t^(ℓ_0(t, j)) (Φ(t, start)^T q̃_t)^T S_0^(j)

A_eff is the delta rule's parallel (UT) form with the values taken out (kernels/delta_rule/parallel.py):

    A_eff = (scale Q K^T ∘ D) (I + A)^{-1} diag(β),    A_ij = β_i D_ij k_i · k_j (j < i),  D_ij = e^{G_i - G_j}

with G the cumulative log-decay and every pairwise term masked to j ≤ i in one document. M = (I + A)^{-1}
diag(β) is kernels/delta_rule/chunk.py's `chunk_terms` (one chunk of length T) applied to identity
values: its U~ is M itself, one triangular solve. The same terms give the initial state's query,
Q_eff = scale diag(Γ) Q - (Q K^T ∘ D) W (the rows of q_t^T Φ(t, start), zero off the first document), and
the final state: token s's write to the end is K_eff[s] = Φ(T-1, s) k_s β_s = (M^T K_d)[s], summed into the
bucket of its level seen from the last position, and the initial state is carried by
Φ(T-1, start) = Γ_T I - K_d^T W into the bucket its level moves to. ℓ and ℓ_0 are kernels/loglinear's
(`fenwick_level`, `initial_levels`), capped at L - 1. O(T^2 (K + V + T)) work and T^2 memory per head.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.delta_rule.chunk import chunk_terms
from kernels.loglinear.parallel import initial_levels
from kernels.loglinear.reference import fenwick_level
from kernels.segments import positions_in_document


def loglinear_gdn_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                           beta: Float[Array, "B T H"], g: Float[Array, "B T H"] | None,
                           lam: Float[Array, "B T H L"], segment_ids: Int[Array, "B T"] | None,
                           S0: Float[Array, "B H L K V"], n0: Int[Array, " B"], *, scale: float):
    """Float32 inputs; segment_ids as kernels/__init__.py; S0, n0 the Fenwick states and position of token 0.
    Returns o (B, T, H, V), the final states (B, H, L, K, V) and count (B,)."""
    Bsz, T, H, K = q.shape
    L = lam.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(T, dtype=jnp.float32)[None, :, None, :], (Bsz, T, H, T))  # (B, T, H, T)
    terms = chunk_terms(q, k, eye, beta, g, scale=scale, segment_ids=segment_ids, chunk_size=T)
    P, Qs, M, W, Kd, gamma = (x[:, :, 0] for x in terms)  # one chunk: (B, H, T, ...); M (B, H, T, T)
    A_eff = P @ M  # (B, H, T, T): scale q_t^T Φ(t, s) k_s β_s, causal, one document
    pos = positions_in_document(segment_ids, Bsz, T, start=n0)  # (B, T)
    level = jnp.minimum(fenwick_level(pos[:, :, None], pos[:, None, :]), L - 1)  # (B, T, T)
    index = jnp.broadcast_to(level[:, None], (Bsz, H, T, T))  # (B, H, T, T)
    weight = jnp.take_along_axis(jnp.moveaxis(lam, 1, 2), index, axis=-1)  # (B, H, T, T): λ_t at ℓ(t, s)
    o = jnp.einsum("bhts,bshv->bthv", A_eff * weight, v)
    # The initial state: bucket j read through q_t^T Φ(t, start), weighted at its level ℓ_0(t, j).
    Q_eff = Qs - P @ W  # (B, H, T, K)
    at = jnp.broadcast_to(initial_levels(pos, n0, L)[:, :, None], lam.shape)  # (B, T, H, L)
    o = o + jnp.einsum("bthl,bhtk,bhlkv->bthv", jnp.take_along_axis(lam, at, axis=-1), Q_eff, S0)
    # Final state: each token of the last document in its bucket as seen from the last position.
    last = pos[:, -1]  # (B,)
    bucket = jnp.minimum(fenwick_level(last[:, None], pos), L - 1)  # (B, T)
    onehot = (bucket[..., None] == jnp.arange(L)).astype(jnp.float32)  # (B, T, L)
    K_eff = jnp.einsum("bhrs,bhrk->bhsk", M, Kd)  # (B, H, T, K): Φ(T-1, s) k_s β_s, 0 off the last document
    S = jnp.einsum("bsl,bhsk,bshv->bhlkv", onehot, K_eff, v)
    Phi = gamma[..., None] * jnp.eye(K) - jnp.einsum("bhrk,bhrj->bhkj", Kd, W)  # (B, H, K, K) Φ(T-1, start)
    moved = (initial_levels(last[:, None], n0, L)[:, 0, :, None] == jnp.arange(L)).astype(jnp.float32)  # (B, j, L)
    S = S + jnp.einsum("bjl,bhkm,bhjmv->bhlkv", moved, Phi, S0)
    return o, S, last + 1
