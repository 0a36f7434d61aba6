"""Gated slot attention's fast forms: pass 1 (the slot scores, gated on the output side) in a chunked or
a quadratic form written here, the softmax over the slots, then pass 2 through the GLA op (kernels/gla,
query a, key s, value v, log-decay g, scale 1) in the same mode.

Pass 1 is u_i,m = sum_{j <= i} A_ij s_j,m e^{b_i,m - b_j,m} with A_ij = scale q_i . k_j and b the
cumulative log-decay: the decay multiplies a slot of the output, so A is one plain matmul and the decay
goes onto s and onto u (in GLA it sits on the contracted key channels). Its state K~ (M x K) obeys GLA's
recurrence with key s and value k, so it crosses chunks exactly as GLA's state does.

Chunked (C tokens per chunk, b the prefix sum of g inside the chunk, r a reference point):
    u_[n] = [A ⊙ mask](s ⊙ decay) + e^{b} ⊙ (S_[n-1] q)           S_[n-1] = K~ entering chunk n
    K~_[n] = diag(e^{b_{C-1}}) K~_[n-1] + (s ⊙ e^{b_{C-1} - b})^T K
Stability, as kernels/gla/chunk.py: no exponent is ever positive. Inside a sub-chunk of c = 16 tokens
the decay e^{b_i - b_j} is taken pairwise, (c, c, M), masked to j <= i before exp; for a key in an
earlier sub-chunk it is split at r = b at the end of the sub-chunk before the query's,
e^{b_i - r} e^{r - b_j}, both <= 1, so that part is the matmul A (s ⊙ e^{r - b}) scaled by e^{b_i - r}.
The chunk-end exponents are suffix sums of g (not differences of prefix sums).

Quadratic: u = [A ⊙ mask ⊙ e^{L}] s per slot, L_ij = sum_{j < t <= i} g_t a masked cumulative sum
(B, T, T, H, M): O(T^2 M) memory, for moderate T and as a cross-check.

Documents and padding as the GLA forms: pair terms need doc(i) == doc(j); the entering state reaches
only tokens of its document and survives a chunk only without a document start; padding tokens have
q = k = s = 0 and g = 0.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import carry_states, document_masks, split_chunks
from kernels.gla import gla
from kernels.segments import document_index, entering_state

SUB_CHUNK = 16


def slot_scores_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], s: Float[Array, "B T H M"],
                      g: Float[Array, "B T H M"], *, scale: float = 1.0, segment_ids: Int[Array, "B T"] | None = None,
                      initial_state: Float[Array, "B H M K"] | None = None, chunk_size: int = 64):
    """Pass 1, chunked. Returns (u (B, T, H, M) float32, K~_T (B, H, M, K) float32)."""
    B, T, H, K = q.shape
    M = s.shape[-1]
    C = min(chunk_size, T)
    c = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n = C // c
    q, k, s, g = (split_chunks(x.astype(jnp.float32), C) for x in (q, k, s, g))  # (B, N, C, H, D)
    N = q.shape[1]
    sees_state, same_doc, in_last_doc, keep = document_masks(segment_ids, B, T, C)
    causal = jnp.tril(jnp.ones((C, C), bool))
    A = jnp.einsum("bnihk,bnjhk->bnhij", q * scale, k) * (same_doc & causal)[:, :, None]  # (B, N, H, C, C)
    b = jnp.cumsum(g, axis=2)  # (B, N, C, H, M)

    # Diagonal sub-chunk blocks: pairwise decay from sums inside the sub-chunk.
    ss, gs = (x.reshape(B, N, n, c, H, M) for x in (s, g))
    b_sub = jnp.cumsum(gs, axis=3)  # (B, N, n, c, H, M): b_i - r
    A_diag = jnp.moveaxis(jnp.diagonal(A.reshape(B, N, H, n, c, n, c), axis1=3, axis2=5), -1, 3)  # (B, N, H, n, c, c)
    tri = jnp.tril(jnp.ones((c, c), bool))[:, :, None, None]  # (c, c, 1, 1)
    pair = jnp.where(tri, b_sub[:, :, :, :, None] - b_sub[:, :, :, None, :], -jnp.inf)  # (B, N, n, c, c, H, M)
    u = jnp.einsum("bnhsij,bnsjhm,bnsijhm->bnsihm", A_diag, ss, jnp.exp(pair))  # (B, N, n, c, H, M)

    # Earlier sub-chunks: through r = b at the end of the sub-chunk before the query's.
    if n > 1:
        bs = b.reshape(B, N, n, c, H, M)
        r = jnp.concatenate([jnp.zeros_like(bs[:, :, :1, -1]), bs[:, :, :-1, -1]], axis=2)  # (B, N, n, H, M)
        earlier = (jnp.arange(C)[None, :] < (jnp.arange(n) * c)[:, None])[:, :, None, None]  # (n, C, 1, 1)
        to_ref = jnp.where(earlier, r[:, :, :, None] - b[:, :, None], -jnp.inf)  # (B, N, n, C, H, M)
        s_off = s[:, :, None] * jnp.exp(to_ref)
        off = jnp.einsum("bnhsij,bnsjhm->bnsihm", A.reshape(B, N, H, n, c, C), s_off)  # (B, N, n, c, H, M)
        u = u + off * jnp.exp(b_sub)
    u = u.reshape(B, N, C, H, M)

    # Across chunks: the state is GLA's with key s and value k.
    suffix = jnp.flip(jnp.cumsum(jnp.flip(g, axis=2), axis=2), axis=2)  # (B, N, C, H, M): sum_{t >= j} g_t
    to_end = jnp.concatenate([suffix[:, :, 1:], jnp.zeros_like(suffix[:, :, :1])], axis=2)  # sum_{t > j}
    update = jnp.einsum("bnjhm,bnjhk->bnhmk", s * jnp.exp(to_end) * in_last_doc[..., None, None], k)
    carry = (jnp.exp(b[:, :, -1]) * keep[..., None, None])[..., None]  # (B, N, H, M, 1)
    S_before, S = carry_states(carry, update, entering_state(initial_state, (B, H, M, K)), axis=1)
    u = u + jnp.exp(b) * sees_state[..., None, None] * jnp.einsum("bnhmk,bnihk->bnihm", S_before, q * scale)
    return u.reshape(B, N * C, H, M)[:, :T], S


def slot_scores_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], s: Float[Array, "B T H M"],
                         g: Float[Array, "B T H M"], *, scale: float = 1.0,
                         segment_ids: Int[Array, "B T"] | None = None,
                         initial_state: Float[Array, "B H M K"] | None = None):
    """Pass 1, quadratic. Returns (u (B, T, H, M) float32, K~_T (B, H, M, K) float32)."""
    B, T, H, K = q.shape
    q, k, s, g = (x.astype(jnp.float32) for x in (q, k, s, g))
    S0 = entering_state(initial_state, (B, H, s.shape[-1], K))
    doc = document_index(segment_ids, B, T)
    t = jnp.arange(T)
    L = jnp.cumsum(jnp.where((t[:, None] > t[None, :])[None, :, :, None, None], g[:, :, None], 0.0),
                   axis=1)  # (B, T_i, T_j, H, M)
    mask = (t[:, None] >= t[None, :]) & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    A = jnp.einsum("bihk,bjhk->bhij", q * scale, k) * mask[:, None]  # (B, H, T, T)
    first_doc = (doc == 0)[..., None, None]  # (B, T, 1, 1)
    b = jnp.cumsum(g, axis=1)  # (B, T, H, M)
    u = jnp.einsum("bhij,bjhm,bijhm->bihm", A, s, jnp.exp(L)) + \
        jnp.exp(b) * first_doc * jnp.einsum("bhmk,bihk->bihm", S0, q * scale)
    in_last_doc = (doc == doc[:, -1:])[..., None, None]
    S = (jnp.exp(b[:, -1]) * first_doc[:, -1])[..., None] * S0 + \
        jnp.einsum("bjhm,bjhk->bhmk", s * jnp.exp(L[:, -1]) * in_last_doc, k)
    return u, S


def gsa_two_pass(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                 s: Float[Array, "B T H M"], g: Float[Array, "B T H M"], *, scale: float, mode: str, chunk_size: int,
                 impl: str, segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Pass 1 in `mode` ("chunk" or "parallel"), softmax, pass 2 the GLA op in `mode` with `impl`.
    Returns (o (B, T, H, V) in q's dtype, (K~_T, V~_T) float32)."""
    K0, V0 = initial_state or (None, None)
    kwargs = dict(scale=scale, segment_ids=segment_ids, initial_state=K0)
    u, Ks = (slot_scores_chunk(q, k, s, g, chunk_size=chunk_size, **kwargs) if mode == "chunk"
             else slot_scores_parallel(q, k, s, g, **kwargs))
    a = jax.nn.softmax(u, axis=-1)  # (B, T, H, M)
    o, Vs = gla(a, s.astype(jnp.float32), v.astype(jnp.float32), g.astype(jnp.float32), scale=1.0,
                segment_ids=segment_ids, initial_state=V0, output_final_state=True, mode=mode, chunk_size=chunk_size,
                impl=impl)
    return o.astype(q.dtype), (Ks, Vs)
