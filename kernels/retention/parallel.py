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

from jaxtyping import Array, Float

from kernels.scalar_decay import scalar_decay_parallel


def retention_parallel(q, k, v, log_gamma: Float[Array, " H"], **kwargs):
    """`retention`'s arguments (kernels/retention/__init__.py; shapes checked in scalar_decay_parallel)
    with log_gamma = log(gamma). Returns (o (B, T, H, V) in q's dtype, S float32)."""
    return scalar_decay_parallel(q, k, v, log_gamma, **kwargs)
