"""Causal linear attention (no decay) in its quadratic, attention-like form, plain JAX.

    O = scale * ((Q K^T ⊙ M) V + Q S_0)          M_ij = [j <= i] [doc(i) == doc(j)]
    S_T = [doc(T-1) == 0] S_0 + sum_j [doc(j) == doc(T-1)] k_j v_j^T

doc(t) counts the document starts up to t, so the initial state S_0 only reaches tokens of the first
document. Costs O(T^2) time and memory per head: meant for short sequences and as a cross-check.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def linear_attention_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                              v: Float[Array, "B T H V"], *, scale: float = 1.0,
                              segment_ids: Int[Array, "B T"] | None = None,
                              initial_state: Float[Array, "B H K V"] | None = None):
    B, T, H, K = q.shape
    out_dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q = q * scale
    S0 = (jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    doc = document_index(segment_ids, B, T)

    mask = jnp.tril(jnp.ones((T, T), bool)) & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
    scores = jnp.einsum("bihk,bjhk->bhij", q, k) * mask[:, None]
    first_doc = (doc == 0)[..., None, None]  # (B, T, 1, 1)
    o = jnp.einsum("bhij,bjhv->bihv", scores, v) + jnp.einsum("bihk,bhkv->bihv", q * first_doc, S0)

    in_last_doc = (doc == doc[:, -1:])[..., None, None]
    S = jnp.where(first_doc[:, -1:, :, :], S0, 0.0) + jnp.einsum("bjhk,bjhv->bhkv", k * in_last_doc, v)
    return o.astype(out_dtype), S
