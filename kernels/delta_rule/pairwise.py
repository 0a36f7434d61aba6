"""Per-key-channel gates (Kimi Delta Attention) inside the delta-rule Pallas kernels: the decayed
pairwise products of a chunk and their pullback, on (C, K) tiles, shared by the GPU (pallas.py,
Triton) and TPU (pallas_tpu.py, Mosaic) kernels. Plain jnp on values already loaded from refs, so
the same code lowers to both (and runs in both interpreters).

With G_i in R^K the chunk-local cumulative log-decay of token i (g <= 0, so G_i <= G_j for j <= i),

    P_ij  = sum_k q'_ik k_jk e^{G_ik - G_jk}        KK_ij = sum_k k_ik k_jk e^{G_ik - G_jk}

for the visible pairs (j <= i, same document), 0 elsewhere. There is no matmul form that is exact:
(Q ⊙ e^{G}) (K ⊙ e^{-G})^T needs e^{-G_j}, which overflows float32 once a channel has decayed past
e^-88 inside the chunk (4.4 tokens of gate -20), and a reference point inside the chunk only moves
the problem. So, as the GLA GPU kernel (kernels/gla/pallas.py), one loop step per key j forms
e^{G_i - G_j} for all queries i at once as a (C, K) tile, with the exponent set to 0 before exp
where i does not see j (i < j, where G_i - G_j >= 0 could overflow). Every exponent is <= 0, every
factor in [0, 1]: nothing overflows for any gate <= 0, and a factor underflows to 0 only where the
token loop's product is below float32's range too. C steps of O(C K) vector work per chunk
(fla's chunk_kda instead splits the chunk into 16-token sub-chunks joined by matmuls through a
reference point at the sub-chunk boundary, both exponents <= 0; the loop is simpler and also exact,
and is not measured against it).

Pullback, with dP, dKK the cotangents of P, KK (zero where not visible):

    dq'_i      = sum_j dP_ij  k_j ⊙ e^{G_i - G_j}                  (query side of P)
    dk_row_i   = sum_j dKK_ij k_j ⊙ e^{G_i - G_j}                  (row side of KK)
    dk_key_j   = sum_i (dP_ij q'_i + dKK_ij k_i) ⊙ e^{G_i - G_j}   (key side of P and KK)
    dL/dG      = q' ⊙ dq' + k ⊙ (dk_row - dk_key)                  (C, K): G_i enters with +, G_j with -

Rows and columns are picked from tiles by a mask and a reduction (the index j is a loop counter;
kernels/pallas_blocks.py's row_of, col_of, row, column): no transposes or dynamic slices on chip.
Loop counters, iotas and 0/1 tiles come from kernels/x64.py (int32 and float32 under x64).
"""

import jax.numpy as jnp

from kernels.pallas_blocks import col_of, row_of
from kernels.x64 import fori_loop, indicator, iota

f32 = jnp.float32


def key_decay(G, vis, j):
    """Key j of a chunk with per-channel gates: e^{G_i - G_j} (C, K) for every query i, the exponent
    masked to 0 before exp where i does not see j (i < j: G_i - G_j >= 0 could overflow), and the
    queries that see it (C, 1) bool."""
    see = col_of(indicator(vis), j) > 0
    return jnp.exp(jnp.where(see, G - row_of(G, j), 0.0)), see


def pair_scores(q, k, G, vis, with_q=True):
    """The decayed products of per-channel gates, sum_k x_ik k_jk e^{G_ik - G_jk} for visible pairs
    (vis (C, C)), 0 elsewhere: (P = Q' K^T decayed, KK = K K^T decayed), (C, C) each (P None unless
    with_q). One loop step per key j, exact (key_decay)."""
    C = q.shape[0]

    def key(j, carry):
        P, KK = carry
        E, see = key_decay(G, vis, j)
        kE = row_of(k, j) * E  # (C, K): k_j e^{G_i - G_j}
        col = iota((1, C), 1) == j
        KK = jnp.where(col, jnp.where(see, jnp.sum(k * kE, axis=1, keepdims=True), 0.0), KK)
        if with_q:
            P = jnp.where(col, jnp.where(see, jnp.sum(q * kE, axis=1, keepdims=True), 0.0), P)
        return P, KK

    zero = jnp.zeros((C, C), f32)
    P, KK = fori_loop(0, C, key, (zero, zero))
    return (P if with_q else None), KK


def pair_grads(q, k, G, vis, dP, dKK):
    """The pullback of pair_scores: dP = dL/dP and dKK = dL/dKK (C, C), zero where not visible.
    Returns dq (w.r.t. q'), dk and dL/dG through the pairs, (C, K) each: dk sums the row side of KK
    (k_i) and the key side of P and KK (k_j), dG = q' ⊙ dq + k ⊙ (dk_row - dk_key)."""
    C = q.shape[0]

    def key(j, carry):
        dq, dk_row, dk_key = carry
        E, _ = key_decay(G, vis, j)
        kE = row_of(k, j) * E
        dPj, dKj = col_of(dP, j), col_of(dKK, j)  # (C, 1): dL/dP_ij, dL/dKK_ij over queries i
        dkj = jnp.sum((dPj * q + dKj * k) * E, axis=0, keepdims=True)  # (1, K)
        return dq + dPj * kE, dk_row + dKj * kE, dk_key + jnp.where(iota((C, 1), 0) == j, dkj, 0.0)

    zero = jnp.zeros(q.shape, f32)
    dq, dk_row, dk_key = fori_loop(0, C, key, (zero, zero, zero))
    return dq, dk_row + dk_key, q * dq + k * (dk_row - dk_key)
