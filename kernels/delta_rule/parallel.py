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

from kernels.delta_rule.chunk import chunk_terms
from kernels.segments import entering_state


def delta_rule_parallel(q, k, v, beta, g=None, *, scale: float, segment_ids=None, initial_state=None):
    """Arguments, shapes and returns as `delta_rule_recurrent` (reference.py; shapes are checked at
    the entry, `delta_rule`)."""
    B, T, H, K = q.shape
    terms = chunk_terms(q, k, v, beta, g, scale=scale, segment_ids=segment_ids, chunk_size=T)
    P, Qs, Ut, W, Kd, gamma = (x[:, :, 0] for x in terms)  # one chunk: (B, H, T, ...)
    S0 = entering_state(initial_state, (B, H, K, v.shape[-1]))
    U = Ut - jnp.einsum("BHTK,BHKV->BHTV", W, S0)  # (B, H, T, V)
    o = jnp.einsum("BHTK,BHKV->BHTV", Qs, S0) + jnp.einsum("BHTS,BHSV->BHTV", P, U)
    final = gamma[..., None] * S0 + jnp.einsum("BHTK,BHTV->BHKV", Kd, U)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), final
