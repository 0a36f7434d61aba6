"""Chunkwise-parallel gated linear attention (Yang et al., 2024, the chunkwise form with
secondary-level chunking), plain JAX.

With chunks of C tokens, b_i = sum_{t <= i in the chunk} g_t (B, C, H, K) and S_[n] the state after
chunk n:

    O_[n] = scale * (P V + (Q ⊙ e^{b}) S_[n-1])        P_ij = [j <= i] sum_k q_ik k_jk e^{b_ik - b_jk}
    S_[n] = diag(e^{b_{C-1}}) S_[n-1] + (K ⊙ e^{b_{C-1} - b})^T V

Stability: e^{b_i - b_j} must not be split into e^{b_i} e^{-b_j}, since e^{-b_j} overflows when the
gates are small. P is built from sub-chunks of c = 16 tokens (the paper's secondary chunking):
- inside a sub-chunk, e^{b_i - b_j} is computed pairwise, (c, c, K), with the exponent masked to
  j <= i before exp;
- for j in an earlier sub-chunk than i, through a reference point r between them (here b at the
  end of the sub-chunk before i's): e^{b_i - b_j} = e^{b_i - r} e^{r - b_j}, both exponents <= 0,
  so that part is a plain matmul of rescaled queries and keys.
Every exponent is <= 0, so nothing overflows; underflow to 0 only where the true value is below
float32 range. For precision, the in-sub-chunk exponents and b_{C-1} - b_j are sums of the gates
they span (sub-chunk prefix sums, chunk suffix sums), not differences of chunk-long prefix sums.
The (K, V) state is carried through a `lax.scan` over chunks. Memory per head: O(T (c + C / c) K)
for the rescaled pairs, against O(T C K) for a fully pairwise chunk.

Documents (`segment_ids`): with doc(t) the running count of document starts, P also requires
doc(i) == doc(j); the carried state is seen only by tokens of the document of the token before the
chunk, kept only if the chunk holds no document start, and the update sums only keys of the chunk's
last document. Decay across a boundary is never used, so resets are exact.

Any T: padding tokens get zero q, k, v and g = 0, so they neither add to nor decay the state.
C is min(chunk_size, T); c is 16 when 16 divides C, else C.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import carry_states, document_masks, split_chunks
from kernels.segments import entering_state

SUB_CHUNK = 16


def gla_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
              g: Float[Array, "B T H K"], *, scale: float = 1.0, segment_ids: Int[Array, "B T"] | None = None,
              initial_state: Float[Array, "B H K V"] | None = None, chunk_size: int = 64):
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], q.dtype
    C = min(chunk_size, T)
    c = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    n = C // c
    q, k, v, g = (split_chunks(x.astype(jnp.float32), C) for x in (q, k, v, g))  # (B, N, C, H, D)
    N = q.shape[1]
    q = q * scale
    b = jnp.cumsum(g, axis=2)  # (B, N, C, H, K), <= 0, non-increasing along the chunk
    b_last = b[:, :, -1]  # (B, N, H, K)
    sees_state, same_doc, in_last_doc, keep = document_masks(segment_ids, B, T, C)

    # Diagonal sub-chunk blocks: pairwise decay, from log-decays summed inside the sub-chunk (fewer
    # terms than b, so b_i - b_j loses less to cancellation).
    qs, ks, gs = (x.reshape(B, N, n, c, H, K) for x in (q, k, g))
    b_sub = jnp.cumsum(gs, axis=3)  # (B, N, n, c, H, K): b_i - r, r = b at the end of the previous sub-chunk
    causal = jnp.tril(jnp.ones((c, c), bool))[:, :, None, None]  # (c, c, 1, 1)
    pair = jnp.where(causal, b_sub[:, :, :, :, None] - b_sub[:, :, :, None, :], 0.0)  # (B, N, n, c, c, H, K)
    diag = jnp.einsum("bnsihk,bnsjhk,bnsijhk->bnhsij", qs, ks, jnp.exp(pair)) * causal[..., 0, 0]
    diag = jnp.einsum("bnhsij,st->bnhsitj", diag, jnp.eye(n, dtype=jnp.float32)).reshape(B, N, H, C, C)

    # Off-diagonal blocks: reference point r = b at the end of the sub-chunk before the query's.
    bs = b.reshape(B, N, n, c, H, K)
    r = jnp.concatenate([jnp.zeros_like(bs[:, :, :1, -1]), bs[:, :, :-1, -1]], axis=2)  # (B, N, n, H, K)
    q_off = qs * jnp.exp(b_sub)  # (B, N, n, c, H, K): q_i e^{b_i - r}
    earlier = (jnp.arange(C)[None, :] < (jnp.arange(n) * c)[:, None])[:, :, None, None]  # (n, C, 1, 1)
    to_ref = jnp.where(earlier, r[:, :, :, None] - b[:, :, None], 0.0)  # (B, N, n, C, H, K)
    k_off = k[:, :, None] * jnp.exp(to_ref) * earlier
    off = jnp.einsum("bnsihk,bnsjhk->bnhsij", q_off, k_off).reshape(B, N, H, C, C)

    o = jnp.einsum("bnhij,bnjhv->bnihv", (diag + off) * same_doc[:, :, None], v)  # (B, N, C, H, V)

    # b_{C-1} - b_j as a sum of the later gates (suffix sum) rather than a difference of prefix sums.
    suffix = jnp.flip(jnp.cumsum(jnp.flip(g, axis=2), axis=2), axis=2)  # (B, N, C, H, K): sum_{t >= j} g_t
    to_end = jnp.concatenate([suffix[:, :, 1:], jnp.zeros_like(suffix[:, :, :1])], axis=2)  # sum_{t > j}
    k_to_end = k * jnp.exp(to_end) * in_last_doc[..., None, None]
    update = jnp.einsum("bnjhk,bnjhv->bnhkv", k_to_end, v)  # (B, N, H, K, V)
    carry = (jnp.exp(b_last) * keep[..., None, None])[..., None]  # (B, N, H, K, 1): no document start in chunk
    S_before, S = carry_states(carry, update, entering_state(initial_state, (B, H, K, V)), axis=1)  # (B, N, H, K, V)
    o = o + jnp.einsum("bnihk,bnhkv->bnihv", q * jnp.exp(b) * sees_state[..., None, None], S_before)
    return o.reshape(B, N * C, H, V)[:, :T].astype(out_dtype), S
