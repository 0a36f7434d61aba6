"""The mLSTM cell (Beck et al., 2024, "xLSTM: Extended Long Short-Term Memory", sec. 2.3, the
recurrent form with the max stabiliser), token by token in float32: the ground truth for
parallel.py and chunk.py.

Per head, with scalar gate pre-activations ĩ_t, f̃_t and log f_t = logsigmoid(f̃_t):

    m_t = max(log f_t + m_{t-1}, ĩ_t)                                  the stabiliser
    C_t = e^{log f_t + m_{t-1} - m_t} C_{t-1} + e^{ĩ_t - m_t} k_t v_t^T     k_t scaled by K^-1/2
    n_t = e^{log f_t + m_{t-1} - m_t} n_{t-1} + e^{ĩ_t - m_t} k_t
    h_t = C_t^T q_t / max(|n_t^T q_t|, e^{-m_t})

(C_t, n_t) is e^{-m_t} times the unstabilised state, so h_t equals C q / max(|n q|, 1) of the
unstabilised cell whatever m: every form computes the same function, and the state (C, n, m) they
return is the same triple.

Code names: `C` (B, H, K, V) is the paper's C_t transposed (K x V, so h = q C, as the linear-attention
ops of this package store it); `n` (B, H, K); `m` (B, H); `i_pre` ĩ and `f_pre` f̃ (B, T, H), the
gates' pre-activations. The state at a document start is C = 0, n = 0, m = 0, as the official code
starts every sequence (xlstm's mLSTMCell.step, mlstm_kernels' recurrent and chunkwise forms); with
`segment_ids`, the state is set to that zero state before the update at every document start; token 0
continues `initial_state`.

Departure: no eps in the denominator (the official code adds 1e-6 to max(|n q|, e^{-m})); without it
the output is exactly independent of the stabiliser, which is what lets the forms agree.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_starts


def mlstm_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"], i_pre: Float[Array, "B H"],
               f_pre: Float[Array, "B H"], state: tuple):
    """One token from state (C, n, m). Returns (h (B, H, V), (C, n, m)), float32."""
    C, n, m = state
    q, k, v, i_pre, f_pre = (x.astype(jnp.float32) for x in (q, k, v, i_pre, f_pre))
    k = k * k.shape[-1] ** -0.5
    log_f = jax.nn.log_sigmoid(f_pre)
    m_new = jnp.maximum(log_f + m, i_pre)
    forget, gain = jnp.exp(log_f + m - m_new), jnp.exp(i_pre - m_new)  # (B, H) each
    C = forget[..., None, None] * C + gain[..., None, None] * k[..., :, None] * v[..., None, :]
    n = forget[..., None] * n + gain[..., None] * k
    num = jnp.einsum("bhk,bhkv->bhv", q, C)
    den = jnp.maximum(jnp.abs(jnp.sum(q * n, axis=-1)), jnp.exp(-m_new))  # (B, H)
    return num / den[..., None], (C, n, m_new)


def zero_state(B: int, H: int, K: int, V: int) -> tuple:
    """The state before a document: C = 0 (B, H, K, V), n = 0 (B, H, K), m = 0 (B, H), float32."""
    return jnp.zeros((B, H, K, V), jnp.float32), jnp.zeros((B, H, K), jnp.float32), jnp.zeros((B, H), jnp.float32)


def entering(initial_state: tuple | None, B: int, H: int, K: int, V: int) -> tuple:
    """The state before token 0 in float32: `initial_state` (C, n, m), or the zero state when None."""
    if initial_state is None:
        return zero_state(B, H, K, V)
    return tuple(x.astype(jnp.float32) for x in initial_state)


def mlstm_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                    i_pre: Float[Array, "B T H"], f_pre: Float[Array, "B T H"], *,
                    segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """lax.scan of `mlstm_step` over time. Returns (h (B, T, H, V) in q's dtype, (C, n, m) float32)."""
    B, T, H, K = q.shape
    state = entering(initial_state, B, H, K, v.shape[-1])
    starts = jnp.zeros((B, T), bool) if segment_ids is None else document_starts(segment_ids)

    def body(state, xs):
        *x_t, start_t = xs
        state = tuple(jnp.where(start_t.reshape((B,) + (1,) * (s.ndim - 1)), 0.0, s) for s in state)  # new document
        h_t, state = mlstm_step(*x_t, state)
        return state, h_t

    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, i_pre, f_pre, starts))  # (T, B, ...)
    state, h = jax.lax.scan(body, state, time_major)
    return jnp.moveaxis(h, 0, 1).astype(q.dtype), state
