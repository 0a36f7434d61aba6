"""Log-linear Mamba-2 (Guo, Yang, Goel, Xing, Dao & Kim, 2025, "Log-Linear Attention", arXiv:2506.04761,
Sections 2-3), token by token in float32: the truth for parallel.py.

Mamba-2's one state per head becomes a Fenwick tree of states, one per level ℓ = 0 .. L-1. The prefix
0 .. t of a query at position t (counted inside its document) is cut into buckets: level 0 holds the
token t alone, level ℓ ≥ 1 the tokens s < t whose highest bit that differs from t is bit ℓ - 1 (so
the bucket exists when bit ℓ - 1 of t is set, and holds 2^(ℓ-1) tokens). The level of a key s is

    ℓ(t, s) = bit_length(t XOR s)        (0 for s = t; at most ceil(log2 T) for s < t < T)

which is the mask of the official code's quadratic form written in closed form (tests check the two
agree). Per head, with S^(ℓ)_t ∈ R^{P × N} and m = lssb(t) the number of trailing zero bits of t:

    S^(m+1) <- Σ_{ℓ ≤ m+1} S^(ℓ),   S^(ℓ) <- 0 for 1 ≤ ℓ ≤ m     the buckets of t - 1 below m + 1 merge
    S^(ℓ)_t = exp(Δ_t A) S^(ℓ) for every ℓ,   S^(0)_t = Δ_t x_t B_t^T        (after the decay)
    y_t = Σ_ℓ λ_t^(ℓ) S^(ℓ)_t C_t + D x_t

so that y_t = Σ_{s ≤ t} λ_t^(ℓ(t, s)) exp(Σ_{s < r ≤ t} Δ_r A) (C_t · B_s) Δ_s x_s + D x_t: Mamba-2's
output with each key's term weighted by the query's weight for that key's level.

Code name -> paper symbol: x -> x (B, T, H, P) (the values V = Δ x), dt -> Δ (B, T, H) > 0, A -> A (H,)
< 0 (the scalar gate a_t = exp(Δ_t A)), B, C -> B, C (B, T, G, N) (keys K and queries Q, shared by the
H / G heads of a group), lam -> λ (B, T, H, L) ≥ 0 (the per-level weights, fla's `level_scales`), D ->
D (H,); the state `S` (B, H, L, P, N) holds S^(0) .. S^(L-1) and `n` (B,) int32 the number of tokens of
the current document seen so far (the position of the next token, which decides the merge).

Departures, all named:
- A finite number of levels L (from λ's last axis): a key whose level would be L or more is counted at
  level L - 1, so once a document passes 2^(L-1) tokens the top state absorbs all older buckets (at
  lssb(t) + 1 ≥ L - 1 every level merges into L - 1). With L = ceil(log2 T) + 1 no key reaches it.
- An initial state S_0 continuing a document at position n_0 is merged as the recurrence merges it:
  its level j reaches the query at p as level max(j, bit_length(p XOR (n_0 - 1))) (capped at L - 1);
  at n_0 = 0 (a fresh document with a non-zero state, which decoding never makes) all of it sits at
  level L - 1, as lssb(0) is taken to be 32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.ssd.reference import heads_from_groups


def bit_length(x: Int[Array, "..."]) -> Int[Array, "..."]:
    """Number of bits of int32 x (32 for a negative x, 0 for 0)."""
    return 32 - jax.lax.clz(x.astype(jnp.int32))


def fenwick_level(t: Int[Array, "..."], s: Int[Array, "..."]) -> Int[Array, "..."]:
    """The level ℓ(t, s) = bit_length(t XOR s) of key position s in query position t's Fenwick partition
    (s ≤ t, both counted from the document's start)."""
    return bit_length(jnp.bitwise_xor(t, s))


def trailing_zeros(n: Int[Array, "..."]) -> Int[Array, "..."]:
    """lssb(n), the number of trailing zero bits of int32 n; 32 for n = 0."""
    n = n.astype(jnp.int32)
    return jax.lax.population_count(jnp.bitwise_and(n, -n) - 1)


def merge_levels(S: Float[Array, "B H L K V"], n: Int[Array, " B"]) -> Float[Array, "B H L K V"]:
    """The Fenwick merge before position n: levels 0 .. u merge into level u = min(lssb(n) + 1, L - 1), the
    levels below it emptied."""
    L = S.shape[2]
    up = jnp.minimum(trailing_zeros(n) + 1, L - 1)[:, None]  # (B, 1)
    level = jnp.arange(L)[None]  # (1, L)
    shape = (S.shape[0], 1, L) + (1,) * (S.ndim - 3)
    merging = (level <= up).reshape(shape)  # (B, 1, L, 1, 1)
    merged = jnp.sum(jnp.where(merging, S, 0.0), axis=2, keepdims=True)  # (B, H, 1, K, V)
    return jnp.where(merging, jnp.where((level == up).reshape(shape), merged, 0.0), S)


def loglinear_step(S: Float[Array, "B H L P N"], n: Int[Array, " B"], x: Float[Array, "B H P"],
                   dt: Float[Array, "B H"], A: Float[Array, " H"], B: Float[Array, "B G N"], C: Float[Array, "B G N"],
                   lam: Float[Array, "B H L"], D: Float[Array, " H"] | None = None):
    """One token at position n of its document: returns (S_t, n + 1, y_t), float32 states and output."""
    f32 = jnp.float32
    H = x.shape[1]
    x, dt, lam = x.astype(f32), dt.astype(f32), lam.astype(f32)
    B, C = heads_from_groups(B.astype(f32), H), heads_from_groups(C.astype(f32), H)  # (B, H, N)
    S = merge_levels(S, n)
    S = jnp.exp(dt * A.astype(f32))[:, :, None, None, None] * S  # every bucket decays by a_t
    S = S.at[:, :, 0].add((dt[..., None] * x)[..., None] * B[:, :, None, :])  # level 0 = the token itself
    y = jnp.einsum("bhl,bhlpn,bhn->bhp", lam, S, C)
    if D is not None:
        y = y + D.astype(f32)[:, None] * x
    return S, n + 1, y


def loglinear_recurrent(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
                        B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], lam: Float[Array, "B T H L"],
                        D: Float[Array, " H"] | None, starts: Bool[Array, "B T"], S0: Float[Array, "B H L P N"],
                        n0: Int[Array, " B"]):
    """lax.scan over time; at a document start the states and the count restart from zero. Returns y (B, T, H, P)
    float32, the final states (B, H, L, P, N) and count (B,)."""

    def step(carry, inputs):
        S, n = carry
        x_t, dt_t, B_t, C_t, lam_t, start_t = inputs
        S = jnp.where(start_t[:, None, None, None, None], 0.0, S)
        n = jnp.where(start_t, 0, n)
        S, n, y = loglinear_step(S, n, x_t, dt_t, A, B_t, C_t, lam_t, D)
        return (S, n), y

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, dt, B, C, lam, starts)]  # (T, B, ...)
    (S, n), y = jax.lax.scan(step, (S0.astype(jnp.float32), n0.astype(jnp.int32)), time_major)
    return jnp.moveaxis(y, 0, 1), S, n
