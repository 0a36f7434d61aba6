"""Causal linear attention without decay, token by token: the ground truth for chunk.py and parallel.py.

Katharopoulos et al., 2020, "Transformers are RNNs: Fast Autoregressive Transformers with Linear
Attention", the causal recurrent form, with the feature map already applied to q and k and without the
normaliser (a layer gets it by appending a ones column to v):

    S_t = S_{t-1} + k_t v_t^T          S_t in R^{K x V}, S_{-1} = initial_state (zero by default)
    o_t = scale * q_t S_t

Code names: `state` is S (B, H, K, V); q, k (B, T, H, K) are phi(Q), phi(K) of the paper.
With `segment_ids`, S is set to zero before the update at every document start (t >= 1 where the id
changes); token 0 continues `initial_state`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents


def linear_attention_step(q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
                          state: Float[Array, "B H K V"], scale: float = 1.0):
    """One token: S <- S + k v^T, o = scale * q S. Returns (o (B, H, V), S), both float32."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    state = state + k[..., :, None] * v[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q * scale, state), state


def linear_attention_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
                               v: Float[Array, "B T H V"], *, scale: float = 1.0,
                               segment_ids: Int[Array, "B T"] | None = None,
                               initial_state: Float[Array, "B H K V"] | None = None):
    """Scan of `linear_attention_step` over time. Returns (o (B, T, H, V) in q's dtype, S float32)."""
    B, T, H, K = q.shape
    state = entering_state(initial_state, (B, H, K, v.shape[-1]))
    step = lambda S, q_t, k_t, v_t: linear_attention_step(q_t, k_t, v_t, S, scale)
    o, state = scan_documents(step, state, (q, k, v), segment_ids)
    return o.astype(q.dtype), state
