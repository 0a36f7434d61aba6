"""Linear attention with one fixed decay per head, or none: the chunkwise and quadratic forms that
retention (kernels/retention, gamma_h) and causal linear attention (kernels/linear_attention, no
decay) share, since linear attention is retention with gamma = 1:

    S_t = gamma_h S_{t-1} + k_t v_t^T,    o_t = scale * q_t S_t

With log_gamma None every decay factor is left out, not multiplied in as 1, so linear attention does
no work for a decay it lacks. The equations of each form, its departures from the papers and its
treatment of documents and padding are in the op's own chunk.py and parallel.py.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import carry_states, document_masks, split_chunks
from kernels.segments import document_index, entering_state


def scalar_decay_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                       log_gamma: Float[Array, " H"] | None, *, scale: float,
                       segment_ids: Int[Array, "B T"] | None = None,
                       initial_state: Float[Array, "B H K V"] | None = None, chunk_size: int = 64):
    """The chunkwise form (kernels/retention/chunk.py). Returns (o (B, T, H, V) in q's dtype, S float32)."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], q.dtype
    C = min(chunk_size, T)
    q, k, v = (split_chunks(x.astype(jnp.float32), C) for x in (q, k, v))  # (B, N, C, H, D)
    q = q * scale
    sees_state, same_doc, in_last_doc, keep = document_masks(segment_ids, B, T, C)
    sees_state, in_last_doc = sees_state[..., None, None], in_last_doc[..., None, None]  # (B, N, C, 1, 1)

    causal = jnp.tril(jnp.ones((C, C), bool))
    scores = jnp.einsum("bnihk,bnjhk->bnhij", q, k) * (causal & same_doc)[:, :, None]  # (B, N, H, C, C)
    carry = keep[..., None, None, None].astype(jnp.float32)  # (B, N, 1, 1, 1): no document start in the chunk
    if log_gamma is not None:
        N = q.shape[1]
        real = (jnp.arange(N * C) < T).reshape(N, C)
        log_decay = jnp.where(real[..., None], log_gamma.astype(jnp.float32), 0.0)  # (N, C, H): padding 0
        b = jnp.cumsum(log_decay, axis=1)  # (N, C, H), <= 0, non-increasing in i
        b_last = b[:, -1]  # (N, H)
        diff = jnp.where(causal[None, :, :, None], b[:, :, None, :] - b[:, None, :, :], 0.0)  # (N, C, C, H)
        scores = scores * jnp.moveaxis(jnp.exp(diff), -1, 1)  # (N, H, C, C); masked before exp: no overflow
        k = k * jnp.exp(b_last[:, None] - b)[..., None]  # e^{b_{C-1} - b_j}
        carry = carry * jnp.exp(b_last)[..., None, None]  # (B, N, H, 1, 1)
        q_from_start = q * jnp.exp(b)[..., None]
    else:
        q_from_start = q
    o = jnp.einsum("bnhij,bnjhv->bnihv", scores, v)  # (B, N, C, H, V)

    update = jnp.einsum("bnjhk,bnjhv->bnhkv", k * in_last_doc, v)  # (B, N, H, K, V)
    S_before, S = carry_states(carry, update, entering_state(initial_state, (B, H, K, V)), axis=1)
    o = o + jnp.einsum("bnihk,bnhkv->bnihv", q_from_start * sees_state, S_before)
    return o.reshape(B, -1, H, V)[:, :T].astype(out_dtype), S


def scalar_decay_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                          log_gamma: Float[Array, " H"] | None, *, scale: float,
                          segment_ids: Int[Array, "B T"] | None = None,
                          initial_state: Float[Array, "B H K V"] | None = None):
    """The quadratic form (kernels/retention/parallel.py). Returns (o (B, T, H, V) in q's dtype, S float32)."""
    B, T, H, K = q.shape
    out_dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q = q * scale
    S0 = entering_state(initial_state, (B, H, K, v.shape[-1]))
    doc = document_index(segment_ids, B, T)

    mask = jnp.tril(jnp.ones((T, T), bool)) & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    scores = jnp.einsum("bihk,bjhk->bhij", q, k) * mask[:, None]  # (B, H, T, T)
    first_doc = (doc == 0)[..., None, None]  # (B, T, 1, 1)
    q_from_start = q * first_doc
    k_to_end = k * (doc == doc[:, -1:])[..., None, None]  # keys of the last document
    S = jnp.where(first_doc[:, -1:], S0, 0.0)  # S_0 reaches the end only without a document start
    if log_gamma is not None:
        log_gamma = log_gamma.astype(jnp.float32)
        t = jnp.arange(T, dtype=jnp.float32)
        lag = t[:, None] - t[None, :]  # (T, T): i - j
        causal = lag >= 0
        scores = scores * jnp.exp(log_gamma[:, None, None] * jnp.where(causal, lag, 0.0))  # (H, T, T)
        q_from_start = q_from_start * jnp.exp((t[:, None] + 1) * log_gamma)[..., None]
        k_to_end = k_to_end * jnp.exp((T - 1 - t)[:, None] * log_gamma)[..., None]
        S = S * jnp.exp(T * log_gamma)[:, None, None]
    o = jnp.einsum("bhij,bjhv->bihv", scores, v) + jnp.einsum("bihk,bhkv->bihv", q_from_start, S0)
    S = S + jnp.einsum("bjhk,bjhv->bhkv", k_to_end, v)
    return o.astype(out_dtype), S
