"""Titans' deep memory (Behrouz, Zhong & Mirrokni 2025, arXiv 2501.00663, Section 3.1: "deep memory" of L_M >= 2
layers), the two-layer MLP, token by token in float32: the truth for its chunk form (chunk_mlp.py).

As the linear memory (reference.py: momentum, forgetting, mini-batches whose gradients are all taken at their
start, packed documents, the state's layout), with the memory the MLP of titans-pytorch's `MemoryMLP` (depth 2):
no biases, hidden width F (4 K in its NeuralMemory default), the erf GELU between the layers:

    M(x)  = gelu(x M1) M2,   l(M; x_t) = || M(k_t) - v_t ||^2
    u_t   = grad l(W_s; x_t)            one per weight, through kernels/inner_mlp.py's backward from 2 (M(k) - v)
    S_t   = eta_t S_{t-1} - theta_t u_t,   M_t = (1 - alpha_t) M_{t-1} + S_t     (per weight: M1, M2 alike)
    o_t   = M_t(q_t) = gelu(q_t M1_t) M2_t
    at p_t = C - 1 the mini-batch ends: W_s <- M_t.

Code names: the state (W, M, S, pos), W, M, S each a pair (layer 1 (B, H, K, F), layer 2 (B, H, F, V)) float32,
pos (B,) int32; `W0` the pair of learned starts without B; the gates as reference.py.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import inner_mlp
from kernels.titans.reference import titans_reference

EXACT_GELU = True  # titans-pytorch's torch F.gelu: the erf form


def memory_rows(x: Float[Array, "*B C K"], v: Float[Array, "*B C V"], W: tuple):
    """Every row's Z1 and dl/dZ1, dl/dZ2 of l = ||M(x) - v||^2 at the memory W = (W1, W2)."""
    params = (W[0], None, W[1], None)
    Z1, Z2 = inner_mlp.forward(x, params, EXACT_GELU)
    dZ2 = 2.0 * (Z2 - v)
    return Z1, inner_mlp.backward(dZ2, Z1, W[1], EXACT_GELU), dZ2


def weight_terms(w: Float[Array, "*B C"], x: Float[Array, "*B C K"], rows: tuple) -> tuple:
    """sum_c w_c grad l_c for (W1, W2), from `memory_rows`."""
    g1, _, g2, _ = inner_mlp.weighted_grads(w, x, *rows, (None,) * 4, EXACT_GELU)
    return g1, g2


def titans_mlp_step(state: tuple, q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
                    theta: Float[Array, "B H"], log_eta: Float[Array, "B H"], log_decay: Float[Array, "B H"],
                    mini_batch_size: int):
    """One token from (W_s, M, S, p): returns (o_t (B, H, V), the state after it), float32."""
    W, M, S, pos = state
    row = lambda a: a[:, :, None]  # (B, H, 1, K): one row
    u = weight_terms(-theta[..., None], row(k), memory_rows(row(k), row(v), W))  # -theta_t u_t, per weight
    col = lambda a: a[..., None, None]
    S = tuple(col(jnp.exp(log_eta)) * s + g for s, g in zip(S, u))
    M = tuple(col(jnp.exp(log_decay)) * m + s for m, s in zip(M, S))
    o = inner_mlp.forward(row(q), (M[0], None, M[1], None), EXACT_GELU)[1][:, :, 0]
    end = (pos == mini_batch_size - 1)[:, None, None, None]  # the mini-batch's last token: M_t starts the next
    return o, (tuple(jnp.where(end, m, w) for m, w in zip(M, W)), M, S, jnp.where(end[:, 0, 0, 0], 0, pos + 1))


def titans_mlp_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                         theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"],
                         log_decay: Float[Array, "B T H"], W0: tuple, *, mini_batch_size: int,
                         segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """titans_reference's scan of `titans_mlp_step`: (o (B, T, H, V) in q's dtype, (W, M, S, pos)), each of W, M,
    S the pair of the memory's layers."""
    return titans_reference(q, k, v, theta, log_eta, log_decay, W0, mini_batch_size=mini_batch_size,
                            segment_ids=segment_ids, initial_state=initial_state, step=titans_mlp_step)
