"""Chunkwise-parallel retention (Sun et al., 2023, the "chunkwise recurrent representation"),
plain JAX.

With chunks of C tokens, b_i = sum of log(gamma) over the chunk's tokens up to and including i
(so b_i = (i + 1) log gamma inside a full chunk) and S_[n] the state after chunk n:

    O_[n] = scale * ((Q K^T ⊙ D) V + (Q ⊙ e^{b}) S_[n-1])        D_ij = [j <= i] e^{b_i - b_j}
    S_[n] = e^{b_{C-1}} S_[n-1] + (K ⊙ e^{b_{C-1} - b})^T V

Every exponent is <= 0, so nothing overflows (this is the paper's form with the decay written in
log space). The (K, V) state is carried through a `lax.scan` over chunks.

Documents (`segment_ids`): with doc(t) the running count of document starts, D also requires
doc(i) == doc(j); the carried state is seen only by tokens of the document of the token before the
chunk, kept only if the chunk holds no document start, and the update sums only the keys of the
chunk's last document. Decay across a boundary is never used, so resets are exact.

Any T: padding tokens get zero q, k, v and log-decay 0 (gamma = 1), so they neither add to nor decay
the state.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def retention_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                    log_gamma: Float[Array, " H"], *, scale: float = 1.0,
                    segment_ids: Int[Array, "B T"] | None = None,
                    initial_state: Float[Array, "B H K V"] | None = None, chunk_size: int = 64):
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], q.dtype
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = ((0, 0), (0, N * C - T), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x.astype(jnp.float32), pad).reshape(B, N, C, H, -1) for x in (q, k, v))
    q = q * scale
    S0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    real = (jnp.arange(N * C) < T).reshape(N, C)
    log_decay = jnp.where(real[..., None], log_gamma.astype(jnp.float32), 0.0)  # (N, C, H)
    b = jnp.cumsum(log_decay, axis=1)  # (N, C, H), <= 0, non-increasing in i
    b_last = b[:, -1]  # (N, H)

    doc = document_index(segment_ids, B, T)
    doc = jnp.pad(doc, ((0, 0), (0, N * C - T)), mode="edge").reshape(B, N, C)
    state_doc = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1, -1]], axis=1)  # (B, N)

    causal = jnp.tril(jnp.ones((C, C), bool))
    diff = jnp.where(causal[None, :, :, None], b[:, :, None, :] - b[:, None, :, :], 0.0)  # (N, C, C, H)
    decay = jnp.moveaxis(jnp.exp(diff), -1, 1) * causal  # (N, H, C, C); masked before exp: no overflow
    same_doc = (doc[..., :, None] == doc[..., None, :])[:, :, None]  # (B, N, 1, C, C)
    scores = jnp.einsum("bnihk,bnjhk->bnhij", q, k) * decay * same_doc
    o = jnp.einsum("bnhij,bnjhv->bnihv", scores, v)  # (B, N, C, H, V)

    in_last_doc = (doc == doc[..., -1:])[..., None, None]  # (B, N, C, 1, 1)
    k_to_end = k * jnp.exp(b_last[:, None] - b)[..., None] * in_last_doc
    update = jnp.einsum("bnjhk,bnjhv->bnhkv", k_to_end, v)  # (B, N, H, K, V)
    keep = doc[..., -1] == state_doc  # (B, N): no document start in the chunk
    carry = jnp.exp(b_last)[None, :, :, None, None] * keep[..., None, None, None]  # (B, N, H, 1, 1)

    def body(S, xs):
        carry_n, update_n = xs
        return carry_n * S + update_n, S

    S, S_before = jax.lax.scan(body, S0, (jnp.moveaxis(carry, 1, 0), jnp.moveaxis(update, 1, 0)))
    S_before = jnp.moveaxis(S_before, 0, 1)  # (B, N, H, K, V)
    sees_state = (doc == state_doc[..., None])[..., None, None]  # (B, N, C, 1, 1)
    q_from_start = q * jnp.exp(b)[..., None] * sees_state
    o = o + jnp.einsum("bnihk,bnhkv->bnihv", q_from_start, S_before)
    return o.reshape(B, N * C, H, V)[:, :T].astype(out_dtype), S
