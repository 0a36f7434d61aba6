"""The mLSTM cell chunkwise (Beck et al., 2025, "xLSTM 7B", the chunkwise form of mlstm_kernels),
plain JAX: states between chunks, the quadratic form inside them.

With chunks of C tokens, each chunk n is the block of parallel.py entering from the state
(C_[n-1], n_[n-1], m_[n-1]) after the chunk before:

    h_[n] = attend(log D_[n], g_[n], (C, n, m)_[n-1])                  (parallel.py's equations)
    m_loc = max_j log D_{C-1,j},  U = sum_j e^{log D_{C-1,j} - m_loc} k_j v_j^T,  u alike with k_j
    m_[n] = max(g_{C-1} + m_[n-1], m_loc)
    C_[n] = e^{g_{C-1} + m_[n-1] - m_[n]} C_[n-1] + e^{m_loc - m_[n]} U,   n_[n] alike

The stabiliser is carried with the state: m_loc and U depend on the chunk alone, so the states are one
`lax.scan` over chunks (a max-plus scan for m, a decayed sum for C and n), after which every chunk's
outputs are computed at once. m_[n] is the reference's m after the chunk's last token exactly, so the
final state agrees with the token-by-token one, not only up to the stabiliser.

Documents (`segment_ids`): the masks of kernels.decayed_chunks.document_masks; the entering state is
seen only by tokens of its document and survives the chunk only if no document starts in it; a
document starting inside the chunk restarts from m = 0 (parallel.py).

Any T: padding tokens have log f = 0 and are masked out as keys, so the state after the last chunk
is the state after the last real token. C is min(chunk_size, T).

Departures from mlstm_kernels' chunkwise form: its inter-chunk m is the same max-plus recurrence,
but here the per-token m inside a chunk is the reference's own (max over the entering term and the
row of log D), the log decays are exact interval sums (parallel.py), documents and any T are
supported, and no eps in the denominator (reference.py).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import document_masks, split_chunks
from kernels.mlstm.parallel import attend, block_update, carry, gate_matrix, prepare
from kernels.mlstm.reference import entering


def mlstm_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                i_pre: Float[Array, "B T H"], f_pre: Float[Array, "B T H"], *,
                segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
                chunk_size: int = 64):
    """Returns (h (B, T, H, V) in q's dtype, (C, n, m) float32)."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], q.dtype
    C = min(chunk_size, T)
    state = entering(initial_state, B, H, K, V)
    q, k, v, i_pre, log_f = (split_chunks(x, C) for x in prepare(q, k, v, i_pre, f_pre))  # (B, N, C, H, ...)
    N = q.shape[1]
    real = (jnp.arange(N * C) < T).reshape(N, C)
    log_f = jnp.where(real[..., None], log_f, 0.0)  # padding neither decays nor adds (its k, v are 0)
    sees, same, _, keep = document_masks(segment_ids, B, T, C)  # (B, N, C), (B, N, C, C), _, (B, N)
    mask = jnp.tril(jnp.ones((C, C), bool)) & same & real[:, None, :]  # (B, N, C_i, C_j): real keys only
    flat = lambda x: x.reshape(B * N, *x.shape[2:])  # (B, N, ...) -> (B*N, ...)
    q, k, v, i_pre, log_f, sees, mask = map(flat, (q, k, v, i_pre, log_f, sees, mask))
    log_D, g = gate_matrix(i_pre, log_f, mask)  # (B*N, C, C, H), (B*N, C, H)

    update = block_update(k, v, log_D[:, -1])
    per_chunk = lambda x: jnp.moveaxis(x.reshape(B, N, *x.shape[1:]), 1, 0)  # (B*N, ...) -> (N, B, ...)

    def step(state, xs):
        g_last, keep_n, *update_n = xs
        return carry(state, g_last, keep_n, tuple(update_n)), state

    xs = (per_chunk(g[:, -1]), jnp.moveaxis(keep, 1, 0), *map(per_chunk, update))
    final, before = jax.lax.scan(step, state, xs)  # before: the state entering each chunk, (N, B, ...)
    before = tuple(jnp.moveaxis(s, 0, 1).reshape(B * N, *s.shape[2:]) for s in before)  # (B*N, ...)
    h = attend(q, k, v, log_D, g, sees, before)  # (B*N, C, H, V)
    return h.reshape(B, N * C, H, V)[:, :T].astype(out_dtype), final
