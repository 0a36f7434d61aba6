"""Gated linear attention in a quadratic, attention-like form (Yang et al., 2024, the parallel form),
plain JAX.

    O = scale * (P V + (Q ⊙ e^{b}) S_0)        P_ij = [j <= i] [doc(i) == doc(j)] sum_k q_ik k_jk e^{L_ijk}
    L_ijk = sum_{j < t <= i} g_tk               b_i = sum_{t <= i} g_t
    S_T = [doc(T-1) == 0] diag(e^{b_{T-1}}) S_0 + sum_j [doc(j) == doc(T-1)] (k_j ⊙ e^{L_{T-1,j}}) v_j^T

Stability and precision: L is formed directly as a masked cumulative sum over time of g (every
term <= 0), never as a difference b_i - b_j of two large prefix sums (which cancels catastrophically
for long sequences) and never as e^{b_i} e^{-b_j} (which overflows). This materialises L, a
(T, T, K) tensor per batch row and head, so the form costs O(T^2 K) memory: fine for moderate T and as
a cross-check; use "chunk" for long sequences. doc(t) counts the document starts up to t.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def gla_parallel(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                 g: Float[Array, "B T H K"], *, scale: float = 1.0, segment_ids: Int[Array, "B T"] | None = None,
                 initial_state: Float[Array, "B H K V"] | None = None):
    B, T, H, K = q.shape
    out_dtype = q.dtype
    q, k, v, g = (x.astype(jnp.float32) for x in (q, k, v, g))
    q = q * scale
    S0 = (jnp.zeros((B, H, K, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    doc = document_index(segment_ids, B, T)

    t = jnp.arange(T)
    after_j = (t[:, None] > t[None, :])[None, :, :, None, None]  # (1, T_t, T_j, 1, 1)
    L = jnp.cumsum(jnp.where(after_j, g[:, :, None], 0.0), axis=1)  # (B, T_i, T_j, H, K)
    causal = t[:, None] >= t[None, :]
    same_doc = doc[:, :, None] == doc[:, None, :]
    mask = (causal & same_doc)[:, None]  # (B, 1, T, T)
    scores = jnp.einsum("bihk,bjhk,bijhk->bhij", q, k, jnp.exp(L)) * mask

    first_doc = (doc == 0)[..., None, None]  # (B, T, 1, 1)
    b = jnp.cumsum(g, axis=1)  # (B, T, H, K)
    o = jnp.einsum("bhij,bjhv->bihv", scores, v) + jnp.einsum("bihk,bhkv->bihv", q * jnp.exp(b) * first_doc, S0)

    in_last_doc = (doc == doc[:, -1:])[..., None, None]
    k_to_end = k * jnp.exp(L[:, -1]) * in_last_doc  # (B, T, H, K)
    S = (jnp.exp(b[:, -1]) * first_doc[:, -1])[..., None] * S0 + jnp.einsum("bjhk,bjhv->bhkv", k_to_end, v)
    return o.astype(out_dtype), S
