"""Causal linear attention (no decay) in its quadratic, attention-like form, plain JAX.

    O = scale * ((Q K^T ⊙ M) V + Q S_0)          M_ij = [j <= i] [doc(i) == doc(j)]
    S_T = [doc(T-1) == 0] S_0 + sum_j [doc(j) == doc(T-1)] k_j v_j^T

doc(t) counts the document starts up to t, so the initial state S_0 only reaches tokens of the first
document. Costs O(T^2) time and memory per head: meant for short sequences and as a cross-check.
"""

from kernels.scalar_decay import scalar_decay_parallel


def linear_attention_parallel(q, k, v, **kwargs):
    """`linear_attention`'s arguments (kernels/linear_attention/__init__.py; shapes checked in
    scalar_decay_parallel). Returns (o (B, T, H, V) in q's dtype, S float32)."""
    return scalar_decay_parallel(q, k, v, None, **kwargs)  # retention with gamma = 1, no decay factors
