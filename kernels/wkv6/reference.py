"""WKV6 reference: the RWKV-6 ("Finch") recurrence token by token, in float32.

Peng et al., 2024, "Eagle and Finch: RWKV with Matrix-Valued States and Dynamic Recurrence"
(arXiv:2404.05892), eq. for wkv_t. Per head, with a (K, V) state S:

    o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T)
    S_t = diag(w_t) S_{t-1} + k_t v_t^T

Code names -> paper symbols: r -> r_t (receptance), k -> k_t, v -> v_t, log_w -> log w_t (the op
takes the log of the data-dependent decay, <= 0; the model's w_t = exp(-exp(d_t)) gives
log_w = -exp(d_t)), u -> u (the "bonus" for the current token, `time_faaaa` in the official code).
The official CUDA kernel keeps the state as (V, K) (rows = value index); we keep (K, V) like every
op here, which is its transpose.

Document resets (segment_ids): S_{t-1} is replaced by zero at a document start t >= 1, before both
the read and the update, so a packed row equals its documents run one by one.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def wkv6_step(state: Float[Array, "B H K V"], r: Float[Array, "B H K"], k: Float[Array, "B H K"],
              v: Float[Array, "B H V"], log_w: Float[Array, "B H K"], u: Float[Array, "H K"]):
    """One token: returns (o_t (B, H, V), S_t (B, H, K, V)), all float32."""
    kv = k[..., :, None] * v[..., None, :]  # (B, H, K, V)
    o = jnp.einsum("bhk,bhkv->bhv", r, state + u[..., None] * kv)
    return o, jnp.exp(log_w)[..., None] * state + kv


def wkv6_recurrent(r: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                   log_w: Float[Array, "B T H K"], u: Float[Array, "H K"], *,
                   segment_ids: Int[Array, "B T"] | None = None,
                   initial_state: Float[Array, "B H K V"] | None = None):
    """lax.scan of `wkv6_step` over time. Returns (o (B, T, H, V) in r's dtype, S_T float32)."""
    B, T, H, K = r.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    step = lambda S, *x_t: wkv6_step(S, *x_t, u.astype(jnp.float32))
    o, state = scan_documents(step, state, tuple(x.astype(jnp.float32) for x in (r, k, v, log_w)), segment_ids)
    return o.astype(r.dtype), state
