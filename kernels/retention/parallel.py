"""Retention in its parallel form (Sun et al., 2023, the parallel representation), plain JAX.

    O = scale * ((Q K^T ⊙ D) V + (Q ⊙ gamma^{i+1}) S_0)      D_ij = [j <= i] [doc(i) == doc(j)] gamma^{i-j}
    S_T = [doc(T-1) == 0] gamma^T S_0 + sum_j [doc(j) == doc(T-1)] gamma^{T-1-j} k_j v_j^T

The powers are computed as exp((i - j) log gamma) with the exponent masked before exp, so none
exceeds 1. doc(t) counts the document starts up to t: D never crosses a document and S_0 reaches only
the first document. Departs from the paper's parallel form in one place: the paper also divides D by
the square root of its row sums and the scores by their clamped absolute row sums for numerical
stability before its GroupNorm; those rescalings are per query row, so the layer's per-head
normalisation undoes them, and they are left out here so all three forms compute the same function.
O(T^2) time and memory per head.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def retention_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                       log_gamma: Float[Array, " H"], *, scale: float = 1.0,
                       segment_ids: Int[Array, "B T"] | None = None,
                       initial_state: Float[Array, "B H K V"] | None = None):
    B, T, H, K = q.shape
    out_dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q = q * scale
    log_gamma = log_gamma.astype(jnp.float32)
    S0 = (jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    doc = document_index(segment_ids, B, T)

    t = jnp.arange(T, dtype=jnp.float32)
    lag = t[:, None] - t[None, :]  # (T, T): i - j
    causal = lag >= 0
    decay = jnp.exp(log_gamma[:, None, None] * jnp.where(causal, lag, 0.0)) * causal  # (H, T, T)
    same_doc = (doc[:, :, None] == doc[:, None, :])[:, None]  # (B, 1, T, T)
    scores = jnp.einsum("bihk,bjhk->bhij", q, k) * decay * same_doc
    first_doc = (doc == 0)[..., None, None]  # (B, T, 1, 1)
    q_from_start = q * jnp.exp((t[:, None] + 1) * log_gamma)[..., None] * first_doc
    o = jnp.einsum("bhij,bjhv->bihv", scores, v) + jnp.einsum("bihk,bhkv->bihv", q_from_start, S0)

    in_last_doc = (doc == doc[:, -1:])[..., None, None]
    k_to_end = k * jnp.exp((T - 1 - t)[:, None] * log_gamma)[..., None] * in_last_doc
    S = (jnp.where(first_doc[:, -1:], jnp.exp(T * log_gamma)[:, None, None], 0.0) * S0
         + jnp.einsum("bjhk,bjhv->bhkv", k_to_end, v))
    return o.astype(out_dtype), S
