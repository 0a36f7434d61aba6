"""Reference stick-breaking attention (Tan et al., 2025, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", ICLR 2025, arXiv:2410.17980), one query at a time, in float32.

For query i and each key j it sees (kernels/stickbreaking/__init__.py: j before i, same document):

    z_ij = q_i . k_j * scale,   β_ij = σ(z_ij)
    A_ij = β_ij Π_{j < l < i, l seen by i} (1 - β_il)      the nearest key breaks the stick first
    o_i  = Σ_j A_ij v_j,        r_i = Π_{j seen by i} (1 - β_ij) = 1 - Σ_j A_ij   (the stick left over)

written in log space as the product over the later keys: log A_ij = log σ(z_ij) + Σ_{l > j} m_il log σ(-z_il),
m_il = 1 where query i sees key l (log(1 - σ(z)) = log σ(-z) = -softplus(z)). A key it does not see has
m_il = 0: it neither takes a share nor breaks the stick. The sum over l > j is an explicit masked (S, S)
product per query, not a cumulative sum (that is xla.py's form): the truth the dense form is tested against.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def stickbreaking_reference(q: Float[Array, "B T H K"], k: Float[Array, "B S G K"], v: Float[Array, "B S G V"],
                            seen: Bool[Array, "B T S"], scale: float):
    """o (B, T, H, V) float32 and r (B, T, H) float32; seen[b, i, j]: query i sees key j."""
    B, T, H, _ = q.shape
    S, G = k.shape[1:3]
    R = H // G
    q = q.astype(jnp.float32).reshape(B, T, G, R, -1)  # (B, T, G, R, K)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    later = jnp.arange(S)[:, None] < jnp.arange(S)[None, :]  # (S, S): [j, l] = l > j

    def one_query(args):
        q_i, m = args  # (B, G, R, K), (B, S)
        z = jnp.einsum("bgrk,bsgk->bgrs", q_i, k) * scale  # (B, G, R, S)
        log_keep = jnp.where(m[:, None, None], jax.nn.log_sigmoid(-z), 0.0)  # log(1 - β), 0 for unseen keys
        log_a = jax.nn.log_sigmoid(z) + jnp.einsum("bgrl,jl->bgrj", log_keep, later.astype(jnp.float32))
        a = jnp.where(m[:, None, None], jnp.exp(log_a), 0.0)  # (B, G, R, S)
        o = jnp.einsum("bgrs,bsgv->bgrv", a, v)  # (B, G, R, V)
        return o.reshape(B, H, -1), jnp.exp(jnp.sum(log_keep, axis=-1)).reshape(B, H)

    o, r = jax.lax.map(one_query, (jnp.moveaxis(q, 1, 0), jnp.moveaxis(seen, 1, 0)))  # (T, B, H, V), (T, B, H)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(r, 0, 1)
