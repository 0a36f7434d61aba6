"""Gated DeltaProduct (Siems et al., 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via
Householder Products"): n delta-rule steps per token, each with its own key, value and beta, the
gate once per token:

    S_{t,0} = alpha_t S_{t-1}
    S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T      j = 1..n
    S_t = S_{t,n},   o_t = scale * S_t^T q_t

Exactly the delta rule over T n sub-steps in a row: token t's sub-step j has key k_{t,j}, value
v_{t,j}, beta_{t,j}, log-decay g_t on j = 1 and 0 on the others, the query q_t on j = n and zero on
the others (whose outputs are dropped); a document start at token t starts at its first sub-step.
So every form and implementation of `delta_rule` serves, unchanged (fla's fused_recurrent path does
the same; its chunk kernel works on the tokens directly); `chunk_size` counts sub-steps.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float

from kernels.delta_rule import delta_rule


def delta_product(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T Nh H K"],
    v: Float[Array, "B T Nh H V"],
    beta: Float[Array, "B T Nh H"],
    g: Float[Array, "B T H"] | Float[Array, "B T H K"] | None = None,
    **kwargs,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"] | None]:
    """q (B, T, H, K); k (B, T, n, H, K), v (B, T, n, H, V), beta (B, T, n, H): token t's n steps in
    order; g (B, T, H) log-decay (or (B, T, H, K) per key channel) or None. Keyword arguments and
    returns as `delta_rule` (segment_ids (B, T) per token); n = 1 is `delta_rule` itself."""
    B, T, n, H, K = k.shape
    if n == 1:
        return delta_rule(q, k[:, :, 0], v[:, :, 0], beta[:, :, 0], g, **kwargs)
    sub = lambda a: a.reshape(B, T * n, *a.shape[3:])  # (B, T n, ...)
    q = sub(jnp.zeros(k.shape, q.dtype).at[:, :, -1].set(q))  # (B, T n, H, K): read at the last sub-step
    if g is not None:
        g = sub(jnp.zeros((B, T, n, *g.shape[2:]), g.dtype).at[:, :, 0].set(g))  # (B, T n, H[, K]): decay first
    segment_ids = kwargs.pop("segment_ids", None)
    if segment_ids is not None:
        segment_ids = jnp.repeat(segment_ids, n, axis=1)  # (B, T n)
    o, final = delta_rule(q, sub(k), sub(v), sub(beta), g, segment_ids=segment_ids, **kwargs)
    return o.reshape(B, T, n, H, -1)[:, :, -1], final  # (B, T, H, V): the output after the last sub-step
