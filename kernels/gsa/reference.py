"""Gated slot attention (Zhang et al., 2024, "Gated Slot Attention for Efficient Linear-Time Sequence
Modeling", arXiv 2409.07146), token by token in float32: the ground truth for chunk.py.

Per head, M memory slots, each with a key row and a value row, written with the forget gate alpha_t
and read by a softmax over the slots:

    K~_t = diag(alpha_t) K~_{t-1} + s_t k_t^T        K~_t in R^{M x K}   (pass 1: the slot keys)
    u_t  = scale * K~_t q_t                           (M,): the query's score against each slot
    a_t  = softmax(u_t)                               over the M slots
    V~_t = diag(alpha_t) V~_{t-1} + s_t v_t^T        V~_t in R^{M x V}   (pass 2: the slot values)
    o_t  = V~_t^T a_t                                 (V,)

with alpha_t = exp(g_t) in (0, 1]^M and s_t the write strength (the layer ties s_t = 1 - alpha_t, the
op takes both). Pass 2 is gated linear attention with query a_t, key s_t, log-decay g_t and scale 1
(kernels/gla); pass 1 gates the slot axis, its OUTPUT side: u_t,m = sum_{j <= t} (q_t . k_j) s_j,m
prod_{j < i <= t} alpha_i,m.

Code names: `state` = (Ks, Vs), K~ (B, H, M, K) and V~ (B, H, M, V); `g` log alpha (B, T, H, M), <= 0;
`s` (B, T, H, M); `u` the slot scores. fla's naive_recurrent_gsa keeps K~ transposed, (K, M); the
zoo keeps both states slot-major. With `segment_ids`, both states are zero before the update at every
document start; token 0 continues `initial_state`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def slot_scores_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], s: Float[Array, "B H M"],
                     g: Float[Array, "B H M"], Ks: Float[Array, "B H M K"], scale: float = 1.0):
    """Pass 1, one token: K~ <- diag(exp(g)) K~ + s k^T, u = scale * K~ q. Returns (u (B, H, M), K~)."""
    Ks = jnp.exp(g)[..., None] * Ks + s[..., :, None] * k[..., None, :]
    return jnp.einsum("bhmk,bhk->bhm", Ks, q * scale), Ks


def gsa_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"], s: Float[Array, "B H M"],
             g: Float[Array, "B H M"], state: tuple, scale: float = 1.0):
    """Both passes, one token (module docstring). Returns (o (B, H, V), (K~, V~)), float32."""
    q, k, v, s, g = (x.astype(jnp.float32) for x in (q, k, v, s, g))
    Ks, Vs = state
    u, Ks = slot_scores_step(q, k, s, g, Ks, scale)
    a = jax.nn.softmax(u, axis=-1)  # (B, H, M)
    Vs = jnp.exp(g)[..., None] * Vs + s[..., :, None] * v[..., None, :]
    return jnp.einsum("bhm,bhmv->bhv", a, Vs), (Ks, Vs)


def gsa_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                  s: Float[Array, "B T H M"], g: Float[Array, "B T H M"], *, scale: float = 1.0,
                  segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Scan of `gsa_step` over time. Returns (o (B, T, H, V) in q's dtype, (K~, V~) float32)."""
    B, T, H, K = q.shape
    M, V = s.shape[-1], v.shape[-1]
    K0, V0 = initial_state or (None, None)
    state = (entering_state(K0, (B, H, M, K)), entering_state(V0, (B, H, M, V)))
    step = lambda S, *x: gsa_step(*x, S, scale)
    o, state = scan_documents(step, state, (q, k, v, s, g), segment_ids)
    return o.astype(q.dtype), state
