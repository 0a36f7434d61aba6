"""Reference (gated) delta rule: the token-by-token recurrence in float32, the truth for every form.

DeltaNet (Schlag et al., 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; Yang et
al., 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length") and Gated
DeltaNet (Yang, Kautz & Hatamizadeh, 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        S_t in R^{K x V}
    o_t = scale * S_t^T q_t

i.e. the state first decays (alpha_t), then the value stored under key k_t, k_t^T alpha_t S_{t-1},
is moved a fraction beta_t of the way towards v_t. Code names: `g` = log alpha_t (g = None means
alpha_t = 1, plain DeltaNet), `beta` = beta_t, `state` = S (B, H, K, V).

Kimi Delta Attention (Kimi Team, 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", and fla's `fla/ops/kda/naive.py`) has a per-channel decay, g (B, T, H, K): each key
row of the state decays at its own rate, first, then the delta update reads the decayed state:

    S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T

The scalar gate is the case alpha_t = a_t 1: both are "decay, then update" (a scalar commutes).

Packed documents: at t >= 1 where segment_ids changes, S_{t-1} is replaced by zero before the update.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def delta_rule_step(
    q: Float[Array, "B H K"],
    k: Float[Array, "B H K"],
    v: Float[Array, "B H V"],
    beta: Float[Array, "B H"],
    g: Float[Array, "B H"] | Float[Array, "B H K"] | None,
    state: Float[Array, "B H K V"],
    scale: float,
) -> tuple[Float[Array, "B H V"], Float[Array, "B H K V"]]:
    """One token of the recurrence, in float32; used by the scan below and by decoding. g: (B, H) one
    log-decay per head, (B, H, K) one per key channel, or None."""
    q, k, v, beta = (x.astype(jnp.float32) for x in (q, k, v, beta))
    state = state.astype(jnp.float32)
    if g is not None:
        alpha = jnp.exp(g.astype(jnp.float32))
        state = (alpha[..., None] if g.ndim == k.ndim else alpha[..., None, None]) * state  # diag(alpha_t) S_{t-1}
    recalled = jnp.einsum("BHK,BHKV->BHV", k, state)  # k_t^T alpha_t S_{t-1}
    # (I - beta k k^T) alpha S + beta k v^T  ==  alpha S + beta k (v - k^T alpha S)^T
    state = state + jnp.einsum("BHK,BHV->BHKV", k, beta[..., None] * (v - recalled))
    o = jnp.einsum("BHK,BHKV->BHV", q, state) * scale
    return o, state


def delta_rule_recurrent(
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
    """lax.scan of `delta_rule_step` over time. Returns (o in q's dtype, final state float32)."""
    B, T, H, K = q.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    step = lambda S, q_t, k_t, v_t, beta_t, g_t: delta_rule_step(q_t, k_t, v_t, beta_t, g_t, S, scale)
    o, state = scan_documents(step, state, (q, k, v, beta, g), segment_ids)
    return o.astype(q.dtype), state
