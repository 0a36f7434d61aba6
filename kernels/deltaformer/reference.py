"""Reference DeltaFormer values (Zhong, Xu, Ao, Shi, 2025, "Understanding Transformer from the Perspective of
Associative Memory", arXiv:2505.19488), one token at a time, in float32: the truth the parallel form is tested
against.

For token i and each earlier key j it sees (kernels/deltaformer/__init__.py: before i, same document; a KV
cache's slots first):

    a_ij = exp(w_i . k_j * scale) / Σ_{l seen by i} exp(w_i . k_l * scale)     0 for a key i does not see
    u_i  = v_i - β_i Σ_j a_ij u_j

u_i is final once computed: the scan writes it into the buffer of u that later tokens read (a cache's slots
hold their u already). A token that sees no key (a document's first) gets u_i = v_i.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def deltaformer_values_reference(w: Float[Array, "B T G K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                                 beta: Float[Array, "B T G"], seen: Bool[Array, "B T _"], scale: float,
                                 cache_k: Float[Array, "B G S K"] | None = None,
                                 cache_u: Float[Array, "B G S V"] | None = None) -> Float[Array, "B T G V"]:
    """u (B, T, G, V) float32; seen[b, i, j]: token i sees key j of [the cache's S slots | the call's T tokens]."""
    B, T, G, V = v.shape
    f32 = lambda a: a.astype(jnp.float32)
    keys, us = f32(k), jnp.zeros((B, T, G, V), jnp.float32)
    if cache_k is not None:
        keys = jnp.concatenate([f32(cache_k).transpose(0, 2, 1, 3), keys], axis=1)  # (B, S + T, G, K)
        us = jnp.concatenate([f32(cache_u).transpose(0, 2, 1, 3), us], axis=1)  # (B, S + T, G, V)
    S = keys.shape[1] - T

    def one_token(us, inputs):
        i, w_i, v_i, b_i, m_i = inputs  # (), (B, G, K), (B, G, V), (B, G), (B, S + T)
        m = m_i[:, None]  # (B, 1, S + T)
        z = jnp.where(m, jnp.einsum("bgk,bsgk->bgs", w_i, keys) * scale, -jnp.inf)  # (B, G, S + T)
        top = jnp.max(z, axis=-1, keepdims=True)
        e = jnp.where(m, jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
        total = jnp.sum(e, axis=-1, keepdims=True)
        a = e / jnp.where(total > 0, total, 1.0)  # the row's softmax over the keys it sees; 0 where none
        u_i = v_i - b_i[..., None] * jnp.einsum("bgs,bsgv->bgv", a, us)  # (B, G, V)
        return jax.lax.dynamic_update_slice_in_dim(us, u_i[:, None], S + i, axis=1), u_i

    time_major = lambda a: jnp.moveaxis(a, 1, 0)  # (T, B, ...)
    xs = (jnp.arange(T), time_major(f32(w)), time_major(f32(v)), time_major(f32(beta)), time_major(seen))
    _, u = jax.lax.scan(one_token, us, xs)  # (T, B, G, V)
    return jnp.moveaxis(u, 0, 1)
