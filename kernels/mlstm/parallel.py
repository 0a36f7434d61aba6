"""The mLSTM cell in its quadratic, attention-like form (Beck et al., 2024, "xLSTM", appendix A.3,
the parallel form with row-wise stabilisation), plain JAX; and the block primitives chunk.py runs on
each chunk.

For a block of L tokens entering from the state (C_0, n_0, m_0), per head (k scaled by K^-1/2):

    log D_ij = sum_{j < t <= i} log f_t + ĩ_j        j <= i, same document (else -inf)
    m_i = max(g_i + m_0, max_j log D_ij)           g_i = sum_{t <= i} log f_t: the reference's m_i
    h_i = [sum_j e^{log D_ij - m_i} (q_i . k_j) v_j + e^{g_i + m_0 - m_i} C_0^T q_i] / max(|den_i|, e^{-m_i})
    den_i = sum_j e^{log D_ij - m_i} (q_i . k_j) + e^{g_i + m_0 - m_i} n_0 . q_i

m_i is the paper's row maximum of log D joined with the entering state's term, so it is the
recurrence's stabiliser exactly (a max-plus scan unrolled), and the last row gives the final state:
C = e^{g + m_0 - m} C_0 + sum_j e^{log D_{L-1,j} - m} k_j v_j^T at m = m_{L-1}, n alike.

Documents: doc(t) counts the document starts up to t. A token of a later document than the entering
state's does not see (C_0, n_0), and its stabiliser restarts from m = 0 at its document's start:
the entering term is then g_i + 0 with g_i summed over i's document only. Every exponent is <= 0.

Departures from the official parallel form (xlstm's parallel_stabilized_simple): log D is formed as
masked cumulative sums of log f over exactly (j, i] (never as the difference of two prefix sums,
which cancels over long sequences); the entering state and documents are supported (the official
form starts from zero, one sequence per row); no eps in the denominator (reference.py). Memory
O(T^2 H): a cross-check and a form for short sequences; use "chunk" for long ones.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.mlstm.reference import entering
from kernels.segments import document_index

NEG = -1e30  # the log weight of a masked pair: e^{NEG - m} is 0, and NEG - NEG is not NaN as -inf - -inf is


def gate_matrix(i_pre: Float[Array, "Z C H"], log_f: Float[Array, "Z C H"], mask: Bool[Array, "Z C C"]):
    """log D (Z, C_i, C_j, H), NEG where mask[i, j] is False, and g (Z, C, H): sum of log f_t over the
    tokens t <= i that mask[i, t] keeps (i's document within the block)."""
    L = log_f.shape[1]
    t = jnp.arange(L)
    after_j = (t[:, None] > t[None, :])[None, :, :, None]  # (1, C_t, C_j, 1)
    decay = jnp.cumsum(jnp.where(after_j, log_f[:, :, None], 0.0), axis=1)  # (Z, C_i, C_j, H): sum over (j, i]
    log_D = jnp.where(mask[..., None], decay + i_pre[:, None], NEG)
    g = jnp.sum(jnp.where(mask[..., None], log_f[:, None], 0.0), axis=2)  # (Z, C, H)
    return log_D, g


def attend(q: Float[Array, "Z C H K"], k: Float[Array, "Z C H K"], v: Float[Array, "Z C H V"],
           log_D: Float[Array, "Z C C H"], g: Float[Array, "Z C H"], sees: Bool[Array, "Z C"], state: tuple
           ) -> Float[Array, "Z C H V"]:
    """h of each token of a block from its gate matrix and the state (C_0, n_0, m_0) entering it; k scaled."""
    C0, n0, m0 = state
    init = g + jnp.where(sees[..., None], m0[:, None], 0.0)  # (Z, C, H): the entering state's log weight
    m = jnp.maximum(init, jnp.max(log_D, axis=2))  # (Z, C, H)
    a = jnp.where(sees[..., None], jnp.exp(init - m), 0.0)
    scores = jnp.einsum("zihk,zjhk->zijh", q, k) * jnp.exp(log_D - m[:, :, None])  # (Z, C_i, C_j, H)
    num = jnp.einsum("zijh,zjhv->zihv", scores, v) + a[..., None] * jnp.einsum("zihk,zhkv->zihv", q, C0)
    den = jnp.sum(scores, axis=2) + a * jnp.einsum("zihk,zhk->zih", q, n0)  # (Z, C, H)
    return num / jnp.maximum(jnp.abs(den), jnp.exp(-m))[..., None]


def block_update(k: Float[Array, "Z C H K"], v: Float[Array, "Z C H V"], log_D_last: Float[Array, "Z C H"]):
    """What a block adds to the state, under its own stabiliser: (m_loc (Z, H), U (Z, H, K, V), u (Z, H, K)),
    m_loc = max_j log D_{C-1,j}, U = sum_j e^{log D_{C-1,j} - m_loc} k_j v_j^T, u alike with k_j."""
    m_loc = jnp.max(log_D_last, axis=1)  # (Z, H)
    w = jnp.exp(log_D_last - m_loc[:, None])  # (Z, C, H)
    return m_loc, jnp.einsum("zjh,zjhk,zjhv->zhkv", w, k, v), jnp.einsum("zjh,zjhk->zhk", w, k)


def carry(state: tuple, g_last: Float[Array, "Z H"], keep: Bool[Array, " Z"], update: tuple) -> tuple:
    """The state after a block: the entering one decayed by e^{g_last} where it survives the block (keep:
    no document starts in it; else it restarts from m = 0), plus the block's `update`, one stabiliser."""
    C, n, m = state
    m_loc, U, u = update
    init = g_last + jnp.where(keep[:, None], m, 0.0)
    m_new = jnp.maximum(init, m_loc)  # (Z, H)
    a = jnp.where(keep[:, None], jnp.exp(init - m_new), 0.0)
    b = jnp.exp(m_loc - m_new)
    return a[..., None, None] * C + b[..., None, None] * U, a[..., None] * n + b[..., None] * u, m_new


def prepare(q, k, v, i_pre, f_pre):
    """float32 inputs, k scaled by K^-1/2, log f = logsigmoid(f̃)."""
    q, k, v, i_pre, f_pre = (x.astype(jnp.float32) for x in (q, k, v, i_pre, f_pre))
    return q, k * k.shape[-1] ** -0.5, v, i_pre, jax.nn.log_sigmoid(f_pre)


def mlstm_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                   i_pre: Float[Array, "B T H"], f_pre: Float[Array, "B T H"], *,
                   segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Returns (h (B, T, H, V) in q's dtype, (C, n, m) float32)."""
    B, T, H, K = q.shape
    out_dtype, state = q.dtype, entering(initial_state, B, H, K, v.shape[-1])
    q, k, v, i_pre, log_f = prepare(q, k, v, i_pre, f_pre)
    doc = document_index(segment_ids, B, T)
    mask = jnp.tril(jnp.ones((T, T), bool)) & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    log_D, g = gate_matrix(i_pre, log_f, mask)
    h = attend(q, k, v, log_D, g, doc == 0, state)
    final = carry(state, g[:, -1], doc[:, -1] == 0, block_update(k, v, log_D[:, -1]))
    return h.astype(out_dtype), final
