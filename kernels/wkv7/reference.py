"""WKV7 reference: the RWKV-7 ("Goose") generalised delta rule token by token, in float32.

Peng et al., 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution" (arXiv:2503.14456).
The paper (and the official code) keep the state as (V, K), rows = value index, and write

    S_t = S_{t-1} (diag(w_t) + a_t^T b_t) + v_t^T k_t,      o_t = S_t r_t

with row vectors a_t, b_t, k_t, v_t. Every op here keeps a (K, V) state, the transpose, in which
the same recurrence reads

    S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,      o_t = S_t^T r_t

i.e. with sa_t = a_t^T S_{t-1} (a (V,) row): S_t = diag(w_t) S_{t-1} + b_t sa_t + k_t v_t^T.
The output reads the state AFTER the current token's update (unlike RWKV-6, no separate bonus).

Code names -> paper symbols: r -> r_t, w_log -> log w_t (<= 0; the model's w_t =
exp(-e^{-0.5} sigmoid(d_t)) lies in (0.545, 1)), k -> k~_t (the replaced key), v -> v_t,
a -> -kappa^_t (minus the normalised removal key), b -> kappa^_t * a_t (the removal key times the
in-context learning rate). The op accepts any a, b; the layer passes exactly these.

Document resets (segment_ids): S_{t-1} is replaced by zero at a document start t >= 1.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def wkv7_step(state: Float[Array, "B H K V"], r: Float[Array, "B H K"], w_log: Float[Array, "B H K"],
              k: Float[Array, "B H K"], v: Float[Array, "B H V"], a: Float[Array, "B H K"],
              b: Float[Array, "B H K"]):
    """One token: returns (o_t (B, H, V), S_t (B, H, K, V)), all float32."""
    sa = jnp.einsum("bhk,bhkv->bhv", a, state)  # a_t^T S_{t-1}
    state = (jnp.exp(w_log)[..., None] * state + b[..., :, None] * sa[..., None, :]
             + k[..., :, None] * v[..., None, :])
    return jnp.einsum("bhk,bhkv->bhv", r, state), state


def wkv7_recurrent(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                   v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
                   segment_ids: Int[Array, "B T"] | None = None,
                   initial_state: Float[Array, "B H K V"] | None = None):
    """lax.scan of `wkv7_step` over time. Returns (o (B, T, H, V) in r's dtype, S_T float32)."""
    B, T, H, K = r.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    xs = tuple(x.astype(jnp.float32) for x in (r, w_log, k, v, a, b))
    o, state = scan_documents(wkv7_step, state, xs, segment_ids)
    return o.astype(r.dtype), state
