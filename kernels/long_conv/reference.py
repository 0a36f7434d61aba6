"""Causal depthwise long convolution, the masked-dense truth:

    y[b, t, d] = sum_{s <= t, doc(s) = doc(t)} k[t - s, d] u[b, s, d]

written as the Toeplitz matrix k[t - s] (one per channel) masked to the lower triangle and, with
`segment_ids`, to each document's diagonal block: O(T^2 D) time and memory, in float32.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_index


def long_conv_reference(u: Float[Array, "B T D"], k: Float[Array, "T D"],
                        segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B T D"]:
    Bsz, T, _ = u.shape
    t = jnp.arange(T)
    lag = t[:, None] - t[None, :]  # (T, T): t - s
    toeplitz = jnp.where((lag >= 0)[..., None], k.astype(jnp.float32)[jnp.maximum(lag, 0)], 0)  # (T, T, D)
    doc = document_index(segment_ids, Bsz, T)  # (B, T)
    same = (doc[:, :, None] == doc[:, None, :]).astype(jnp.float32)  # (B, T, T): t and s in one document
    return jnp.einsum("bts,tsd,bsd->btd", same, toeplitz, u.astype(jnp.float32))
