"""kernels/ssd/chunk.py's scalar_gla_chunk, linear attention with a scalar decay per head and token, in its quadratic
form over the whole sequence (kernels/ssd/parallel.py's, with the decay g and the input v apart):

    y_t = Σ_{s <= t} L[t, s] (q_t · k_s) v_s + L[t, -1] h_0 q_t,   L[t, s] = exp(Σ_{s < r <= t} g_r)

O(T^2) work and memory per head, the stable masked segsum of kernels/ssd/parallel.py; L is exactly
0 across documents and the initial state reaches only the first document.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.ssd.parallel import decay_mask, segsum


def scalar_gla_parallel(q: Float[Array, "B T H N"], k: Float[Array, "B T H N"], v: Float[Array, "B T H P"],
                        g: Float[Array, "B T H"], starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"]):
    """float32 in; returns y (B, T, H, P) and the final state (B, H, P, N)."""
    a = jnp.moveaxis(g, 1, 2)  # (B, H, T) log-decays
    doc = jnp.cumsum(starts, axis=1)  # (B, T) document index, 0 for the one continuing h0
    Lmat = decay_mask(segsum(a), doc)  # (B, H, T, T)
    y = jnp.einsum("bhts,bshp->bthp", jnp.einsum("bthn,bshn->bhts", q, k) * Lmat, v)
    from_start = jnp.where((doc == 0)[:, None], jnp.exp(jnp.cumsum(a, axis=-1)), 0.0)  # (B, H, T)
    y = y + jnp.einsum("bthn,bhpn->bthp", q * jnp.moveaxis(from_start, 1, 2)[..., None], h0)
    h = jnp.einsum("bshn,bshp->bhpn", k, v * jnp.moveaxis(Lmat[:, :, -1], 1, 2)[..., None])
    return y, h + from_start[:, :, -1, None, None] * h0
