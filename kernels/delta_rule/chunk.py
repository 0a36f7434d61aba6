"""Chunkwise-parallel (gated) delta rule with the WY/UT representation.

Yang et al., 2024 ("Parallelizing Linear Transformers with the Delta Rule over Sequence Length",
sec. 3) and, for the decay, Yang, Kautz & Hatamizadeh, 2024 ("Gated Delta Networks", sec. 3.3).
Write the recurrence S_t = alpha_t S_{t-1} + k_t u_t^T with the "pseudo-values"
u_t = beta_t (v_t - k_t^T alpha_t S_{t-1}). Inside a chunk of C tokens that starts from state S_0,
with G_i = sum_{j<=i} g_j (cumulative log-decay inside the chunk) and Gamma_i = exp(G_i):

    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i Gamma_i k_i^T S_0

a unit lower-triangular system (I + A) U = diag(beta) V - diag(beta Gamma) K S_0, so
U = U~ - W S_0 with U~ = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta Gamma) K (the UT
transform; solved here with one triangular solve instead of fla's blockwise forward substitution).
Then, with D_ij = exp(G_i - G_j) for j <= i,

    O   = scale * (diag(Gamma) Q S_0 + (Q K^T * D) U)
    S_C = Gamma_C S_0 + (K * D_{C,:}^T)^T U

Only the sequential part, S_0 -> S_C, runs in a lax.scan over chunks; everything else is batched.
Every exponent is G_i or G_i - G_j with j <= i, never positive for a decay (g <= 0), so no exp
overflows however strong the forgetting; fla computes the same differences.

Packed documents (exact, no large-negative-decay trick): with d_i the document index of token i,
every pairwise term (A, Q K^T, D) is multiplied by [d_i == d_j], and the S_0 terms by
c_i = [no document starts in the chunk at or before i]. The chunk is min(chunk_size, T); the
padding that makes T a multiple of C has k = v = beta = g = 0 (and the last document id), so it
leaves the state untouched.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.linalg import unit_lower_inverse
from kernels.segments import document_index


def intra_chunk_terms(q, k, v, beta, g, doc, first):
    """The chunk-local quantities of the formulas above, for chunks along the second-to-last axis.

    q, k (..., C, K); v (..., C, V); beta, g (..., C); doc (..., C) document index of each token;
    first (..., C) bool: True where the token belongs to the document the incoming state S_0 belongs
    to (c_i). All float32; pass q already multiplied by `scale`. Returns (P, Qs, Ut, W, Kd, gamma):
      P  (..., C, C)  Q K^T * D, causal and same-document
      Qs (..., C, K)  c * Gamma * Q       (reads S_0)
      Ut (..., C, V)  U~;  W (..., C, K): U = Ut - W S_0
      Kd (..., C, K)  K weighted by the decay to the chunk end, D_{C,j}
      gamma (...)     c_C Gamma_C, the decay of S_0 across the chunk
    """
    C = q.shape[-2]
    G = jnp.cumsum(g, axis=-1)  # (..., C)
    causal = jnp.tril(jnp.ones((C, C), bool))
    mask = causal & (doc[..., :, None] == doc[..., None, :])  # (..., C, C): j <= i, same document
    D = jnp.where(mask, jnp.exp(jnp.where(mask, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    A = (beta[..., :, None] * jnp.einsum("...ik,...jk->...ij", k, k) * D) * ~jnp.eye(C, dtype=bool)
    decay_in = jnp.where(first, jnp.exp(G), 0.0)  # (..., C): c_i Gamma_i
    rhs = jnp.concatenate([beta[..., None] * v, (beta * decay_in)[..., None] * k], axis=-1)
    sol = unit_lower_inverse(-A) @ rhs  # (I + A)^{-1} rhs
    Ut, W = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]
    P = jnp.einsum("...ik,...jk->...ij", q, k) * D
    Qs = decay_in[..., None] * q
    Kd = D[..., -1, :, None] * k
    return P, Qs, Ut, W, Kd, decay_in[..., -1]


def _heads_first(x, n_pad):
    """(B, T, H, ...) -> (B, H, T + n_pad, ...) float32, zero padded in time."""
    x = jnp.moveaxis(x.astype(jnp.float32), 2, 1)
    return jnp.pad(x, [(0, 0), (0, 0), (0, n_pad)] + [(0, 0)] * (x.ndim - 3))


def delta_rule_chunk(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    beta: Float[Array, "B T H"],
    g: Float[Array, "B T H"] | None = None,
    *,
    scale: float,
    segment_ids: Int[Array, "B T"] | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = min(chunk_size, T)  # a short call pads no further than T
    N = -(-T // C)
    pad = N * C - T
    g = jnp.zeros(beta.shape, jnp.float32) if g is None else g
    qf, kf, vf, bf, gf = (_heads_first(x, pad) for x in (q, k, v, beta, g))  # (B, H, N*C, ...)
    chunked = lambda x: x.reshape(B, H, N, C, *x.shape[3:])  # (B, H, N, C, ...)
    qf, kf, vf, bf, gf = map(chunked, (qf, kf, vf, bf, gf))
    doc = jnp.pad(document_index(segment_ids, B, T), ((0, 0), (0, pad)), mode="edge")  # (B, N*C)
    doc = doc.reshape(B, 1, N, C)
    # The incoming state of chunk n belongs to the document of token nC - 1 (document 0 for n = 0).
    doc_in = jnp.concatenate([jnp.zeros_like(doc[:, :, :1, :1]), doc[:, :, :-1, -1:]], axis=2)  # (B, 1, N, 1)
    first: Bool[Array, "B 1 N C"] = doc == doc_in
    P, Qs, Ut, W, Kd, gamma = intra_chunk_terms(qf * scale, kf, vf, bf, gf, doc, first)

    def step(S, xs):  # S: (B, H, K, V), the state entering the chunk
        Ut_n, W_n, Kd_n, gamma_n = xs
        U_n = Ut_n - jnp.einsum("BHCK,BHKV->BHCV", W_n, S)  # (B, H, C, V)
        S_next = gamma_n[..., None, None] * S + jnp.einsum("BHCK,BHCV->BHKV", Kd_n, U_n)
        return S_next, (S, U_n)

    S0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # (N, B, H, ...)
    final, (S_in, U) = jax.lax.scan(step, S0, tuple(map(chunk_major, (Ut, W, Kd, gamma))))
    S_in, U = jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(U, 0, 2)  # (B, H, N, K, V), (B, H, N, C, V)
    o = jnp.einsum("BHNCK,BHNKV->BHNCV", Qs, S_in) + jnp.einsum("BHNCD,BHNDV->BHNCV", P, U)
    o = o.reshape(B, H, N * C, V)[:, :, :T]  # (B, H, T, V)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), final
