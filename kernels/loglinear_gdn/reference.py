"""Log-linear Gated DeltaNet (Guo, Yang, Goel, Xing, Dao & Kim, 2025, "Log-Linear Attention",
arXiv:2506.04761, Section 4, "Log-Linear Gated DeltaNet"), token by token in float32: the truth for
parallel.py.

Gated DeltaNet's one state per head becomes a Fenwick tree of states S^(0) .. S^(L-1), bucketed exactly
as log-linear Mamba-2's (kernels/loglinear/reference.py: level 0 the token itself, level ℓ ≥ 1 the keys s
with ℓ(t, s) = bit_length(t XOR s) = ℓ, positions inside the document). Every level is moved by the same
gated delta-rule transition; only the token's own write enters level 0. Per head, S^(ℓ) ∈ R^{K × V},
m = lssb(t) the trailing zero bits of the position t:

    S^(m+1) <- Σ_{ℓ ≤ m+1} S^(ℓ),   S^(ℓ) <- 0 for ℓ ≤ m           the buckets of t - 1 below m + 1 merge
    S^(ℓ) <- α_t (I - β_t k_t k_t^T) S^(ℓ) for every ℓ            the delta rule's transition, on each level
    S^(0) <- S^(0) + β_t k_t v_t^T                                the token's own write
    o_t = scale · Σ_ℓ λ_t^(ℓ) S^(ℓ)T q_t

so that, with Φ(t, s) = Π_{s < r ≤ t} α_r (I - β_r k_r k_r^T) (later factors on the left),

    o_t = scale · Σ_{s ≤ t} λ_t^(ℓ(t, s)) (q_t^T Φ(t, s) k_s) β_s v_s

Gated DeltaNet's output with each key's term weighted by the query's λ for the key's level; with λ ≡ 1
the levels sum to Gated DeltaNet's state, S = Σ_ℓ S^(ℓ), and the output is its output.

Code name -> paper symbol: q, k (B, T, H, K) the queries and keys (the layer L2-normalises them), v
(B, T, H, V) the values, beta β (B, T, H), g = log α (B, T, H) ≤ 0 (None: α = 1), lam λ (B, T, H, L)
(fla's and the official code's `l`), scale (K^-1/2 by default); the state `S` (B, H, L, K, V) holds
S^(0) .. S^(L-1) and `n` (B,) int32 the tokens of the current document seen so far (the next position,
which decides the merge), as kernels/loglinear's.

Departures, all named (kernels/loglinear's, which this op shares):
- A finite number of levels L (from λ's last axis): keys of level L or more count at level L - 1.
- An initial state continuing a document at position n_0 is merged as the recurrence merges it (its
  level j reaches position p at level max(j, bit_length(p XOR (n_0 - 1))), capped); at n_0 = 0 all of
  it sits at level L - 1.
- The official H-GDN divides λ by the scale before its kernel multiplies the output by it, so its output
  is unscaled; this op keeps the delta rule's scale (so that λ ≡ 1 is kernels/delta_rule's op exactly),
  and a caller wanting the official form passes scale=1.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.loglinear.reference import merge_levels


def loglinear_gdn_step(S: Float[Array, "B H L K V"], n: Int[Array, " B"], q: Float[Array, "B H K"],
                       k: Float[Array, "B H K"], v: Float[Array, "B H V"], beta: Float[Array, "B H"],
                       g: Float[Array, "B H"] | None, lam: Float[Array, "B H L"], scale: float):
    """One token at position n of its document: returns (S_t, n + 1, o_t), float32 states and output."""
    f32 = jnp.float32
    q, k, v, beta, lam = (a.astype(f32) for a in (q, k, v, beta, lam))
    S = merge_levels(S.astype(f32), n)
    if g is not None:
        S = jnp.exp(g.astype(f32))[:, :, None, None, None] * S  # α_t on every level
    recalled = jnp.einsum("bhk,bhlkv->bhlv", k, S)  # k_t^T α_t S^(ℓ)
    S = S - jnp.einsum("bhk,bhlv->bhlkv", beta[..., None] * k, recalled)  # (I - β_t k_t k_t^T) on every level
    S = S.at[:, :, 0].add(jnp.einsum("bhk,bhv->bhkv", beta[..., None] * k, v))  # level 0 += β_t k_t v_t^T
    o = scale * jnp.einsum("bhl,bhlkv,bhk->bhv", lam, S, q)
    return S, n + 1, o


def loglinear_gdn_recurrent(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                            beta: Float[Array, "B T H"], g: Float[Array, "B T H"] | None,
                            lam: Float[Array, "B T H L"], starts: Bool[Array, "B T"],
                            S0: Float[Array, "B H L K V"], n0: Int[Array, " B"], *, scale: float):
    """lax.scan over time; at a document start the states and the count restart from zero. Returns o (B, T, H, V)
    float32, the final states (B, H, L, K, V) and count (B,)."""

    def step(carry, inputs):
        S, n = carry
        q_t, k_t, v_t, beta_t, g_t, lam_t, start_t = inputs
        S = jnp.where(start_t[:, None, None, None, None], 0.0, S)
        n = jnp.where(start_t, 0, n)
        S, n, o = loglinear_gdn_step(S, n, q_t, k_t, v_t, beta_t, g_t, lam_t, scale)
        return (S, n), o

    time_major = [None if a is None else jnp.moveaxis(a, 1, 0) for a in (q, k, v, beta, g, lam, starts)]  # (T, B, ..)
    (S, n), o = jax.lax.scan(step, (S0.astype(jnp.float32), n0.astype(jnp.int32)), time_major)
    return jnp.moveaxis(o, 0, 1), S, n
