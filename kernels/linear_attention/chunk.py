"""Chunkwise-parallel causal linear attention (no decay), plain JAX.

Split time into chunks of C tokens. With S_[n] the state after chunk n (the chunkwise form of linear
attention as written in Yang et al., 2024, the GLA paper):

    O_[n]   = scale * ((Q_[n] K_[n]^T ⊙ M) V_[n] + Q_[n] S_[n-1])          M: causal mask
    S_[n]   = S_[n-1] + K_[n]^T V_[n]

The intra-chunk part is a (C, C) matmul per chunk, all chunks at once; only the (K, V) state is
carried through a `lax.scan` over chunks.

Documents (`segment_ids`): with doc(t) the running count of document starts, M also requires
doc(i) == doc(j); the carried state belongs to the document of the token before the chunk, so
Q_[n] S_[n-1] is kept only for tokens of that document, and S_[n] keeps S_[n-1] only if the chunk
holds no document start and sums only the keys of the chunk's last document.

Any T: the input is padded with zeros to a multiple of C; zero keys and values add nothing.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def linear_attention_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                           v: Float[Array, "B T H V"], *, scale: float = 1.0,
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

    doc = document_index(segment_ids, B, T)
    doc = jnp.pad(doc, ((0, 0), (0, N * C - T)), mode="edge").reshape(B, N, C)
    # The document the state carried into chunk n belongs to: that of the token before the chunk.
    state_doc = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1, -1]], axis=1)  # (B, N)

    causal = jnp.tril(jnp.ones((C, C), bool))
    mask = causal & (doc[..., :, None] == doc[..., None, :])  # (B, N, C, C)
    scores = jnp.einsum("bnihk,bnjhk->bnhij", q, k) * mask[:, :, None]
    o = jnp.einsum("bnhij,bnjhv->bnihv", scores, v)  # (B, N, C, H, V)

    in_last_doc = (doc == doc[..., -1:])[..., None, None]  # (B, N, C, 1, 1)
    update = jnp.einsum("bnjhk,bnjhv->bnhkv", k * in_last_doc, v)  # (B, N, H, K, V)
    keep = (doc[..., -1] == state_doc)[..., None, None, None]  # (B, N, 1, 1, 1): no start in chunk

    def body(S, xs):
        update_n, keep_n = xs
        return jnp.where(keep_n, S, 0.0) + update_n, S

    S, S_before = jax.lax.scan(body, S0, (jnp.moveaxis(update, 1, 0), jnp.moveaxis(keep, 1, 0)))
    S_before = jnp.moveaxis(S_before, 0, 1)  # (B, N, H, K, V)
    sees_state = (doc == state_doc[..., None])[..., None, None]  # (B, N, C, 1, 1)
    o = o + jnp.einsum("bnihk,bnhkv->bnihv", q * sees_state, S_before)
    return o.reshape(B, N * C, H, V)[:, :T].astype(out_dtype), S
