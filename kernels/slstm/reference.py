"""The sLSTM cell (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", Section 2.2 and
Appendix A), token by token in float32, written as the paper's equations. Per head h, with
block-diagonal recurrent matrices (one K x K block per head and gate) and the previous output h_{t-1}:

    z̃_t = W_z x_t + R_z h_{t-1} + b_z,   and ĩ_t, f̃_t, õ_t likewise
    z_t = tanh(z̃_t),   o_t = σ(õ_t),   log f_t = logsigmoid(f̃_t)  (or f̃_t: the exponential forget gate)
    m_t = max(log f_t + m_{t-1}, ĩ_t)                              the stabiliser
    i'_t = exp(ĩ_t - m_t),   f'_t = exp(log f_t + m_{t-1} - m_t)
    c_t = f'_t c_{t-1} + i'_t z_t,   n_t = f'_t n_{t-1} + i'_t,   h_t = o_t c_t / n_t

The stabiliser scales c and n alike (c_t = c̄_t e^{-m_t}, n_t = n̄_t e^{-m_t} for the unstabilised c̄_t,
n̄_t with i_t = e^{ĩ_t}, f_t = e^{log f_t}), so h_t does not depend on it; it keeps every exponent <= 0.
Once a state has seen a token, n_t >= 1 (either i'_t = 1 or f'_t = 1 at each step), so c / n is safe.

An empty state (n_{t-1} = 0: a zero state, before a document's first token) has no stabiliser of its
own: there m_t = ĩ_t and f'_t = 0, as the official CUDA kernel does per element (its vanilla PyTorch
cell does it only when the whole batch is empty, `torch.all(n == 0)`). The official cells also clamp
i'_t and f'_t at 1 and o_t at 1, which is a no-op here (both exponents are <= 0).

Code names: `x` the input pre-activations W x_t (the layer's projections), gates in the order
(i, f, z, o) on axis 2; `R` (4, H, K, K), h_{t-1} @ R[g, head] the recurrent term of gate g; `b` (4, H, K)
the biases; the state (c, n, m, h), each (B, H, K).

Recurrent only: h_{t-1} enters every gate through R, so the gates of token t are unknown until token
t - 1 is done, and no chunkwise or parallel form exists (as the paper says, unlike the mLSTM).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents

STATE = ("c", "n", "m", "h")  # the order of the state's fields (a tuple of four (B, H, K) arrays)


def log_forget(f_raw: Float[Array, "*b"], forget_gate: str) -> Float[Array, "*b"]:
    """log f_t from f̃_t: logsigmoid (the official default) or the identity (the exponential gate)."""
    return jax.nn.log_sigmoid(f_raw) if forget_gate == "sigmoid" else f_raw


def slstm_step(state: Float[Array, "B 4 H K"], x_t: Float[Array, "B 4 H K"], R: Float[Array, "4 H K K"],
               b: Float[Array, "4 H K"], forget_gate: str = "sigmoid"):
    """One token: the stacked state [c, n, m, h] (B, 4, H, K) float32 before it -> (h_t, state after it)."""
    c, n, m, h = (state[:, j] for j in range(4))
    pre = x_t + jnp.einsum("bhk,ghkj->bghj", h, R) + b  # (B, 4, H, K) ĩ, f̃, z̃, õ
    i_raw, f_raw, z_raw, o_raw = (pre[:, j] for j in range(4))
    log_f = log_forget(f_raw, forget_gate)
    empty = n == 0  # a zero state: no stabiliser yet
    m_new = jnp.where(empty, i_raw, jnp.maximum(log_f + m, i_raw))
    i_gate = jnp.exp(i_raw - m_new)
    # <= 0 wherever n > 0; on an empty state clamped before exp, so neither the value nor its gradient overflows
    f_gate = jnp.where(empty, 0.0, jnp.exp(jnp.minimum(log_f + m - m_new, 0.0)))
    c = f_gate * c + i_gate * jnp.tanh(z_raw)
    n = f_gate * n + i_gate
    h = jax.nn.sigmoid(o_raw) * c / n  # n >= 1 once a token is in (module docstring)
    return h, jnp.stack([c, n, m_new, h], axis=1)  # (B, 4, H, K)


def slstm_reference(x: Float[Array, "B T 4 H K"], R: Float[Array, "4 H K K"], b: Float[Array, "4 H K"] | None = None,
                    *, segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
                    forget_gate: str = "sigmoid"):
    """lax.scan of `slstm_step` over time, the state zeroed at each document start (kernels/segments.py).
    Returns h (B, T, H, K) float32 and the final state (c, n, m, h), each (B, H, K) float32."""
    B, T, _, H, K = x.shape
    R = R.astype(jnp.float32)
    b = jnp.zeros((4, H, K), jnp.float32) if b is None else b.astype(jnp.float32)
    S = jnp.zeros((B, 4, H, K), jnp.float32) if initial_state is None else \
        jnp.stack([entering_state(s, (B, H, K)) for s in initial_state], axis=1)  # (B, 4, H, K)
    step = lambda S, x_t: slstm_step(S, x_t, R, b, forget_gate)
    h, S = scan_documents(step, S, (x.astype(jnp.float32),), segment_ids)
    return h, tuple(S[:, j] for j in range(4))
