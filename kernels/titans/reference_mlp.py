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

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import inner_mlp
from kernels.segments import document_starts

EXACT_GELU = True  # titans-pytorch's torch F.gelu: the erf form


def entering_state(initial_state: tuple | None, W0: tuple, batch: int):
    """(W, M, S, pos) before token 0, float32 (pos int32): `initial_state`, or W0 at position 0."""
    if initial_state is not None:
        W, M, S, pos = initial_state
        f32 = lambda ws: tuple(a.astype(jnp.float32) for a in ws)
        return f32(W), f32(M), f32(S), pos.astype(jnp.int32)
    W = tuple(jnp.broadcast_to(a.astype(jnp.float32), (batch, *a.shape)) for a in W0)
    return W, W, tuple(map(jnp.zeros_like, W)), jnp.zeros((batch,), jnp.int32)


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
    """Scan of `titans_mlp_step` over time, a document start restarting from (W0, W0, 0, 0). Returns
    (o (B, T, H, V) in q's dtype, (W, M, S, pos))."""
    B, T = q.shape[:2]
    f32 = lambda a: a.astype(jnp.float32)
    fresh = entering_state(None, W0, B)
    starts = jnp.zeros((B, T), bool) if segment_ids is None else document_starts(segment_ids)

    def body(state, xs):
        *x_t, start = xs
        state = jax.tree.map(lambda s, s0: jnp.where(start.reshape((B,) + (1,) * (s.ndim - 1)), s0, s), state, fresh)
        o, state = titans_mlp_step(state, *x_t, mini_batch_size)
        return state, o

    time_major = lambda a: jnp.moveaxis(a, 1, 0)  # (T, B, ...)
    xs = tuple(map(time_major, (f32(q), f32(k), f32(v), f32(theta), f32(log_eta), f32(log_decay), starts)))
    state, o = jax.lax.scan(body, entering_state(initial_state, W0, B), xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), state  # (B, T, H, V)
