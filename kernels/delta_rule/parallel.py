"""Parallel (quadratic) form of the (gated) delta rule: the UT transform over the whole sequence.

The chunk form of chunk.py with a single chunk of length T (Yang et al., 2024, "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", sec. 3.1, where the fully parallel
form is the UT transform applied to all T tokens at once):

    U = (I + A)^-1 (diag(beta) V - diag(beta Gamma) K S_0)        A_ij = beta_i e^{G_i - G_j} k_i.k_j, j < i
    O = scale * (diag(Gamma) Q S_0 + (Q K^T * D) U)               D_ij = e^{G_i - G_j}, j <= i
    S_T = Gamma_T S_0 + (K * D_{T,:}^T)^T U

with G_i the cumulative log-decay from the start of the call and pairwise terms masked to the same
document. Unlike linear attention's parallel form, O is not (Q K^T * M) V: the T x T triangular
solve is intrinsic to the delta rule. Cost: T x T memory per head and O(T^2 (K + V)) work, no scan
at all, so it suits short sequences on wide hardware.
With a per-channel gate (g (B, T, H, K), Kimi Delta Attention) the decayed products are chunk.py's
sub-chunked ones over the whole sequence: O(T (16 + T / 16) K) memory per head.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.delta_rule.chunk import intra_chunk_terms
from kernels.segments import document_index


def delta_rule_parallel(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    beta: Float[Array, "B T H"],
    g: Float[Array, "B T H"] | Float[Array, "B T H K"] | None = None,
    *,
    scale: float,
    segment_ids: Int[Array, "B T"] | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    g = jnp.zeros(beta.shape, jnp.float32) if g is None else g
    heads_first = lambda x: jnp.moveaxis(x.astype(jnp.float32), 2, 1)  # (B, H, T, ...)
    qf, kf, vf, bf, gf = map(heads_first, (q, k, v, beta, g))
    doc = document_index(segment_ids, B, T)[:, None]  # (B, 1, T)
    P, Qs, Ut, W, Kd, gamma = intra_chunk_terms(qf * scale, kf, vf, bf, gf, doc, doc == 0)
    S0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    U = Ut - jnp.einsum("BHTK,BHKV->BHTV", W, S0)  # (B, H, T, V)
    o = jnp.einsum("BHTK,BHKV->BHTV", Qs, S0) + jnp.einsum("BHTS,BHSV->BHTV", P, U)
    final = gamma[..., None] * S0 + jnp.einsum("BHTK,BHTV->BHKV", Kd, U)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), final
