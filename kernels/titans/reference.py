"""Titans' neural memory (Behrouz, Zhong & Mirrokni 2025, "Titans: Learning to Memorize at Test Time", arXiv
2501.00663), the linear memory token by token in float32: the truth for the chunk form (chunk.py).

Per head the memory is a linear map M(k) = k M (M (K, V)), trained online on the associative loss
l(M; x_t) = ||k_t M - v_t||^2 by gradient descent with momentum ("surprise") and weight decay ("forgetting"),
in mini-batches of C tokens whose gradients are all taken at the memory the mini-batch started from (the
paper's Section 3.2, its parallel training). Token t sits at position p_t in its mini-batch (0 <= p_t < C):

    u_t = grad_M l(W_s; x_t) = 2 k_t^T (k_t W_s - v_t)       (W_s: the memory before the mini-batch's first token)
    S_t = eta_t S_{t-1} - theta_t u_t                        (the surprise, with momentum eta_t)
    M_t = (1 - alpha_t) M_{t-1} + S_t                        (the memory, forgetting alpha_t)
    o_t = q_t M_t                                            (the retrieval)
    at p_t = C - 1 the mini-batch ends: W_s <- M_t.

With C = 1 this is the fully online rule of the paper's equations (13)-(14). The op takes the gates in log
form, log eta_t and log(1 - alpha_t) (the layer computes them as log-sigmoids), so that the chunk form's
cumulative products are sums that never underflow; theta_t >= 0 as it is.

Packed documents: a document start restarts from the learned initial memory, W_s = M = W_0 with S = 0 and
p = 0, so a document's mini-batches line up with its own positions, as if it ran alone. Token 0 of a call
continues `initial_state` = (W_s, M, S, p) (kernels/__init__.py), which may stop mid-mini-batch: its p says
where, and M, S are the memory and surprise after the last token (M = W_s at p = 0).

Code names: `W` the mini-batch's start W_s, `M` the memory M_{t-1}, `S` the surprise S_{t-1}, all
(B, H, K, V) float32; `pos` p (B,) int32, the next token's position; `theta` (B, T, H); `log_eta` log eta_t,
`log_decay` log(1 - alpha_t) (B, T, H); `W0` the learned initial memory (H, K, V); C `mini_batch_size`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import scan_documents


def entering_state(initial_state: tuple | None, W0: Float[Array, "H K V"] | tuple, batch: int):
    """(W, M, S, pos) before token 0, float32 (pos int32): `initial_state`, or W0 at position 0; W0 the linear
    memory's matrix or the deep memory's tuple of layers (each of W, M, S then a tuple alike)."""
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    if initial_state is not None:
        W, M, S, pos = initial_state
        return f32(W), f32(M), f32(S), pos.astype(jnp.int32)
    W = jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape)), f32(W0))
    return W, W, jax.tree.map(jnp.zeros_like, W), jnp.zeros((batch,), jnp.int32)


def titans_step(state: tuple, q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
                theta: Float[Array, "B H"], log_eta: Float[Array, "B H"], log_decay: Float[Array, "B H"],
                mini_batch_size: int):
    """One token from (W_s, M, S, p): returns (o_t (B, H, V), the state after it), float32."""
    W, M, S, pos = state
    residual = jnp.einsum("bhk,bhkv->bhv", k, W) - v  # k_t W_s - v_t
    u = 2.0 * k[..., :, None] * residual[..., None, :]  # (B, H, K, V): grad of ||k M - v||^2 at W_s
    col = lambda a: a[..., None, None]
    S = col(jnp.exp(log_eta)) * S - col(theta) * u
    M = col(jnp.exp(log_decay)) * M + S
    o = jnp.einsum("bhk,bhkv->bhv", q, M)
    end = (pos == mini_batch_size - 1)[:, None, None, None]  # the mini-batch's last token: M_t starts the next
    return o, (jnp.where(end, M, W), M, S, jnp.where(end[:, 0, 0, 0], 0, pos + 1))


def titans_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                     theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"], log_decay: Float[Array, "B T H"],
                     W0: Float[Array, "H K V"] | tuple, *, mini_batch_size: int,
                     segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
                     step=titans_step):
    """Scan of `step` (titans_step, or the deep memory's) over time, a document start restarting from (W0, W0, 0,
    0). Returns (o (B, T, H, V) in q's dtype, (W, M, S, pos))."""
    B = q.shape[0]
    f32 = lambda a: a.astype(jnp.float32)
    step_t = lambda S, *x_t: step(S, *x_t, mini_batch_size)
    xs = (f32(q), f32(k), f32(v), f32(theta), f32(log_eta), f32(log_decay))
    o, S = scan_documents(step_t, entering_state(initial_state, W0, B), xs, segment_ids,
                          fresh=entering_state(None, W0, B))
    return o.astype(q.dtype), S  # (B, T, H, V)
