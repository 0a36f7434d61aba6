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

Per-channel decay (Kimi Delta Attention, g (B, T, H, K); reference.py): the same derivation with
G_i in R^K and the scalar products replaced by decayed ones, as in GLA's chunk form:

    A_ij = beta_i sum_k k_ik k_jk e^{G_ik - G_jk},    (Q K^T * D)_ij -> sum_k q_ik k_jk e^{G_ik - G_jk}
    W = (I + A)^-1 diag(beta) (K ⊙ Gamma),   O = scale * ((Q ⊙ Gamma) S_0 + P U)
    S_C = diag(Gamma_C) S_0 + (K ⊙ e^{G_C - G})^T U

Numerical safety: e^{G_i - G_j} is never split into e^{G_i} e^{-G_j} (e^{-G_j} overflows float32
once a channel has forgotten past e^-88 inside the chunk). `decayed_scores` builds the decayed
products from sub-chunks of 16 tokens, GLA's secondary chunking (kernels/gla/chunk.py): pairwise,
(c, c, K), inside a sub-chunk, with the exponent masked to j <= i before exp; across sub-chunks
through a reference point r between them, e^{G_i - r} e^{r - G_j}, both exponents <= 0. So every
exponent is <= 0 for g <= 0: nothing overflows, and a factor underflows to 0 only where the true
product is below float32 range anyway. The decay to the chunk end is a suffix sum of the gates, not
a difference of prefix sums. Cost: O(C (c + C / c) K) per chunk and head for the decayed products,
against O(C^2 K) fully pairwise.

Packed documents (exact, no large-negative-decay trick): with d_i the document index of token i,
every pairwise term (A, Q K^T, D) is multiplied by [d_i == d_j], and the S_0 terms by
c_i = [no document starts in the chunk at or before i]. The chunk is min(chunk_size, T); the
padding that makes T a multiple of C has k = v = beta = g = 0 (and the last document id), so it
leaves the state untouched.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from kernels.linalg import unit_lower_inverse
from kernels.segments import document_index, entering_state

SUB_CHUNK = 16


def decayed_scores(a, b, g):
    """P_ij = sum_k a_ik b_jk e^{G_ik - G_jk} for j <= i, 0 for j > i, with G the cumulative sum of
    g <= 0 along the chunk axis: a, b, g (..., C, K) -> (..., C, C). Sub-chunked as the module
    docstring says, so every exponent is <= 0."""
    C, K = a.shape[-2:]
    c = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n, lead = C // c, a.shape[:-2]
    sub = lambda x: x.reshape(*lead, n, c, K)  # (..., n, c, K)
    a_s, b_s, g_s = sub(a), sub(b), sub(g)
    G_s = jnp.cumsum(g_s, axis=-2)  # (..., n, c, K): G_i - r, r = G at the end of the previous sub-chunk
    causal = jnp.tril(jnp.ones((c, c), bool))[:, :, None]  # (c, c, 1)
    pair = jnp.where(causal, G_s[..., :, None, :] - G_s[..., None, :, :], 0.0)  # (..., n, c, c, K)
    diag = jnp.einsum("...sik,...sjk,...sijk->...sij", a_s, b_s, jnp.exp(pair)) * causal[..., 0]
    diag = jnp.einsum("...sij,st->...sitj", diag, jnp.eye(n, dtype=diag.dtype)).reshape(*lead, C, C)
    G = jnp.cumsum(g, axis=-2)  # (..., C, K)
    r = jnp.concatenate([jnp.zeros_like(G_s[..., :1, -1, :]), sub(G)[..., :-1, -1, :]], axis=-2)  # (..., n, K)
    earlier = (jnp.arange(C)[None, :] < (jnp.arange(n) * c)[:, None])[:, :, None]  # (n, C, 1): j before sub-chunk s
    to_ref = jnp.where(earlier, r[..., :, None, :] - G[..., None, :, :], 0.0)  # (..., n, C, K), <= 0
    b_off = jnp.where(earlier, b[..., None, :, :] * jnp.exp(to_ref), 0.0)  # (..., n, C, K)
    off = jnp.einsum("...sik,...sjk->...sij", a_s * jnp.exp(G_s), b_off).reshape(*lead, C, C)
    return diag + off


def intra_chunk_terms(q, k, v, beta, g, doc, first):
    """The chunk-local quantities of the formulas above, for chunks along the second-to-last axis.

    q, k (..., C, K); v (..., C, V); beta (..., C); g (..., C) one log-decay per token or (..., C, K)
    one per key channel; doc (..., C) document index of each token; first (..., C) bool: True where
    the token belongs to the document the incoming state S_0 belongs to (c_i). All float32; pass q
    already multiplied by `scale`. Returns (P, Qs, Ut, W, Kd, gamma):
      P  (..., C, C)  Q K^T * D (or its decayed form), causal and same-document
      Qs (..., C, K)  c * Gamma * Q       (reads S_0)
      Ut (..., C, V)  U~;  W (..., C, K): U = Ut - W S_0
      Kd (..., C, K)  K weighted by the decay to the chunk end, D_{C,j}
      gamma (..., 1) or (..., K)  c_C Gamma_C, the decay of S_0 across the chunk
    """
    C = q.shape[-2]
    causal = jnp.tril(jnp.ones((C, C), bool))
    mask = causal & (doc[..., :, None] == doc[..., None, :])  # (..., C, C): j <= i, same document
    if g.ndim == k.ndim:  # per key channel
        KK, QK = decayed_scores(k, k, g), decayed_scores(q, k, g)  # (..., C, C)
        decay_in = jnp.where(first[..., None], jnp.exp(jnp.cumsum(g, axis=-2)), 0.0)  # (..., C, K): c_i Gamma_i
        suffix = jnp.flip(jnp.cumsum(jnp.flip(g, axis=-2), axis=-2), axis=-2)  # sum_{t >= j} g_t
        to_end = jnp.concatenate([suffix[..., 1:, :], jnp.zeros_like(suffix[..., :1, :])], axis=-2)  # sum_{t > j}
        Kd = jnp.where((doc == doc[..., -1:])[..., None], jnp.exp(to_end), 0.0) * k  # (..., C, K)
    else:
        G = jnp.cumsum(g, axis=-1)  # (..., C)
        D = jnp.where(mask, jnp.exp(jnp.where(mask, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
        KK, QK = jnp.einsum("...ik,...jk->...ij", k, k) * D, jnp.einsum("...ik,...jk->...ij", q, k) * D
        decay_in = jnp.where(first, jnp.exp(G), 0.0)[..., None]  # (..., C, 1): c_i Gamma_i
        Kd = D[..., -1, :, None] * k
    A = jnp.where(mask & ~jnp.eye(C, dtype=bool), beta[..., :, None] * KK, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta[..., None] * decay_in) * k], axis=-1)
    sol = unit_lower_inverse(-A) @ rhs  # (I + A)^{-1} rhs
    Ut, W = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]
    return jnp.where(mask, QK, 0.0), decay_in * q, Ut, W, Kd, decay_in[..., -1, :]


def chunk_terms(q, k, v, beta, g, *, scale: float, segment_ids, chunk_size: int):
    """`intra_chunk_terms` of every chunk of C = min(chunk_size, T) tokens, heads first and chunked,
    (B, H, N, C, ...): the inputs (arguments as `delta_rule`) in float32, g None as 0, zero padded
    in time; c_i marks the tokens of the document the state entering the chunk belongs to."""
    B, T, H, K = q.shape
    C = min(chunk_size, T)  # a short call pads no further than T
    N = -(-T // C)
    g = jnp.zeros(beta.shape, jnp.float32) if g is None else g

    def heads_first(x):  # (B, T, H, ...) -> (B, H, N, C, ...) float32
        x = jnp.moveaxis(x.astype(jnp.float32), 2, 1)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 3))
        return x.reshape(B, H, N, C, *x.shape[3:])

    qf, kf, vf, bf, gf = map(heads_first, (q, k, v, beta, g))
    doc = jnp.pad(document_index(segment_ids, B, T), ((0, 0), (0, N * C - T)), mode="edge")  # (B, N*C)
    doc = doc.reshape(B, 1, N, C)
    # The incoming state of chunk n belongs to the document of token nC - 1 (document 0 for n = 0).
    doc_in = jnp.concatenate([jnp.zeros_like(doc[:, :, :1, :1]), doc[:, :, :-1, -1:]], axis=2)  # (B, 1, N, 1)
    first: Bool[Array, "B 1 N C"] = doc == doc_in
    return intra_chunk_terms(qf * scale, kf, vf, bf, gf, doc, first)


def delta_rule_chunk(q, k, v, beta, g=None, *, scale: float, segment_ids=None, initial_state=None,
                     chunk_size: int = 64):
    """Arguments, shapes and returns as `delta_rule_recurrent` (reference.py; shapes are checked at
    the entry, `delta_rule`), plus chunk_size."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    P, Qs, Ut, W, Kd, gamma = chunk_terms(q, k, v, beta, g, scale=scale, segment_ids=segment_ids,
                                          chunk_size=chunk_size)

    def step(S, xs):  # S: (B, H, K, V), the state entering the chunk
        Ut_n, W_n, Kd_n, gamma_n = xs
        U_n = Ut_n - jnp.einsum("BHCK,BHKV->BHCV", W_n, S)  # (B, H, C, V)
        S_next = gamma_n[..., None] * S + jnp.einsum("BHCK,BHCV->BHKV", Kd_n, U_n)  # gamma_n (B, H, K or 1)
        return S_next, (S, U_n)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # (N, B, H, ...)
    S0 = entering_state(initial_state, (B, H, K, V))
    final, (S_in, U) = jax.lax.scan(step, S0, tuple(map(chunk_major, (Ut, W, Kd, gamma))))
    S_in, U = jnp.moveaxis(S_in, 0, 2), jnp.moveaxis(U, 0, 2)  # (B, H, N, K, V), (B, H, N, C, V)
    o = jnp.einsum("BHNCK,BHNKV->BHNCV", Qs, S_in) + jnp.einsum("BHNCD,BHNDV->BHNCV", P, U)
    o = o.reshape(B, H, -1, V)[:, :, :T]  # (B, H, T, V)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), final
