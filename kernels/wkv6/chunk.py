"""WKV6 chunkwise-parallel form (plain JAX), numerically stable for any decay.

The recurrence (reference.py) o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T), S_t = diag(w_t) S_{t-1} +
k_t v_t^T is cut into chunks of C tokens. With G_t = sum_{i<=t} log w_i inside a chunk (G_{-1} = 0)
and S_0 the state entering the chunk:

    o_t = (r_t * exp(G_{t-1}))^T S_0                                    inter-chunk
        + sum_{s<t} [sum_k r_tk k_sk exp(G_{t-1,k} - G_{s,k})] v_s         intra-chunk
        + (r_t * u * k_t)^T 1 v_t                                           bonus
    S_C = diag(exp(G_{C-1})) S_0 + sum_s (k_s * exp(G_{C-1} - G_s)) v_s^T

Stability: the decay is per channel, so the intra-chunk scores cannot be one matmul of r * exp(G)
with k * exp(-G) (exp(-G) overflows for fast decays); `decayed_scores` (kernels/decayed_chunks.py)
builds them with every exp() argument a sum of log decays <= 0 over its exact interval.

Document resets are masks, never fake decays: a score is kept only inside one document, S_0 is read
only by tokens of the document it belongs to, and only keys of the chunk's last document reach S_C.
Padding to a multiple of C uses r = k = v = 0 and log w = 0, which leaves the state untouched; C is
chunk_size, capped at T rounded up to a multiple of 16 (a short call pads less).
The state update between chunks is a lax.scan over T / C steps.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import carry_states, chunk_inputs, cumsum_exclusive, decayed_scores, from_chunks
from kernels.segments import entering_state


def wkv6_chunk(r: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
               log_w: Float[Array, "B T H K"], u: Float[Array, "H K"], *,
               segment_ids: Int[Array, "B T"] | None = None,
               initial_state: Float[Array, "B H K V"] | None = None, chunk_size: int = 64):
    """Returns (o (B, T, H, V) in r's dtype, S_T (B, H, K, V) float32)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    (rc, kc, vc, lw), (cont, same, last, carry) = chunk_inputs((r, k, v, log_w), segment_ids, chunk_size)
    Gm = cumsum_exclusive(lw)  # (B, H, N, C, K): G_{t-1}
    G_end = jnp.sum(lw, axis=-2)  # (B, H, N, K): G_{C-1}

    A = decayed_scores(rc, kc, lw, inclusive=False) * same  # (B, H, N, C, C)
    bonus = jnp.sum(rc * u.astype(jnp.float32)[:, None, None] * kc, axis=-1, keepdims=True)  # (B, H, N, C, 1)
    o = jnp.einsum("bhnts,bhnsv->bhntv", A, vc) + bonus * vc
    r_in = rc * jnp.exp(Gm) * cont[..., None]  # reads S_0
    k_out = kc * jnp.exp(cumsum_exclusive(lw, reverse=True)) * last[..., None]  # writes S_C
    dS = jnp.einsum("bhnsk,bhnsv->bhnkv", k_out, vc)  # (B, H, N, K, V)
    g_end = jnp.exp(G_end) * carry[..., None]  # (B, H, N, K)
    S_in, S_T = carry_states(g_end[..., None], dS, entering_state(initial_state, (B, H, K, V)), axis=2)
    o = o + jnp.einsum("bhntk,bhnkv->bhntv", r_in, S_in)
    return from_chunks(o, T).astype(r.dtype), S_T
