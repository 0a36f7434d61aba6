"""DeltaFormer (Zhong, Xu, Ao, Shi, 2025, arXiv:2505.19488): softmax attention over values u that the delta rule
has corrected in the softmax kernel's feature space. One entry point, the form picked by `impl`.

    u_i = v_i - β_i Σ_{j < i} softmax_j(w_i . k_j * scale) u_j        strictly earlier keys of i's document
    o_t = Σ_{j <= t} softmax_j(q_t . k_j * scale) u_j                  softmax attention with u as values

scale defaults to K^-1/2 in both (flash-linear-attention's). The write query w is the caller's: the layer
passes k, q or its own projection (layers/deltaformer.py); w, k, v and β are per kv head (G), so u is too and
the second stage is GQA attention of H query heads over (k, u), kernels/attention. A token that sees no
earlier key (the first of a document) keeps u_i = v_i; u never crosses a document boundary.

- `deltaformer_values`: u alone, optionally after a KV cache whose slots already hold k and u (a decode call:
  slot s of row b is seen by its new tokens when s < cache.length[b] and it is of the token's document).
  "reference": reference.py, token by token; "xla" / "auto": parallel.py, one masked softmax and a
  blockwise triangular solve (blocks of chunk_size rows).
- `deltaformer`: u, then `kernels.attention.attention(q, k, u)`, causal and per document (impl "reference"
  runs attention's reference; "xla" and "auto" its XLA forms, "auto" its Pallas kernels where they apply).
There is no Pallas kernel for u (impl="pallas" is refused); mode is "parallel", the one form.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.attention import CacheView, attention
from kernels.deltaformer.parallel import deltaformer_values_parallel, masked_softmax, solve_unit_lower
from kernels.deltaformer.reference import deltaformer_values_reference

__all__ = ["deltaformer", "deltaformer_values", "deltaformer_values_parallel", "deltaformer_values_reference",
           "masked_softmax", "solve_unit_lower"]
MODES = ("parallel",)


def deltaformer_values(w: Float[Array, "B T G K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                       beta: Float[Array, "B T G"], *, segment_ids: Int[Array, "B T"] | None = None,
                       cache: CacheView | None = None, scale: float | None = None, mode: str = "parallel",
                       chunk_size: int = 64, impl: str = "auto") -> Float[Array, "B T G V"]:
    """u (B, T, G, V) float32 of the T tokens. cache: a KV cache (heads first, CacheView) whose `v` holds the
    slots' u; with it, segment_ids (B, T) and cache.segment_ids (B, S) are both given (documents) or both None."""
    check_mode(mode, chunk_size, "deltaformer", MODES)
    check_no_pallas(impl, "deltaformer")
    B, T, G, K = k.shape
    if w.shape != k.shape or v.shape[:3] != (B, T, G) or beta.shape != (B, T, G):
        raise ValueError(f"deltaformer: w {w.shape}, k {k.shape}, v {v.shape}, beta {beta.shape}; expected w as k "
                         "(B, T, G, K), v (B, T, G, V), beta (B, T, G)")
    scale = K ** -0.5 if scale is None else scale
    t = jnp.arange(T)
    seen = jnp.broadcast_to(t[None, None, :] < t[None, :, None], (B, T, T))  # (B, T, T): j < i
    if segment_ids is not None:
        seen = seen & (segment_ids[:, None, :] == segment_ids[:, :, None])
    cache_k = cache_u = None
    if cache is not None:
        if (segment_ids is None) != (cache.segment_ids is None):
            raise ValueError("deltaformer: give segment_ids and cache.segment_ids together, or neither")
        cache_k, cache_u = cache.k, cache.v
        S = cache_k.shape[2]
        length = jnp.broadcast_to(cache.length, (B,))
        slots = jnp.broadcast_to(jnp.arange(S)[None, None, :] < length[:, None, None], (B, T, S))  # written slots
        if segment_ids is not None:
            slots = slots & (cache.segment_ids[:, None, :] == segment_ids[:, :, None])
        seen = jnp.concatenate([slots, seen], axis=-1)  # (B, T, S + T)
    if impl == "reference":
        return deltaformer_values_reference(w, k, v, beta, seen, scale, cache_k, cache_u)
    return deltaformer_values_parallel(w, k, v, beta, seen, scale, chunk_size, cache_k, cache_u)


def deltaformer(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                beta: Float[Array, "B T G"], *, w: Float[Array, "B T G K"] | None = None,
                segment_ids: Int[Array, "B T"] | None = None, scale: float | None = None, mode: str = "parallel",
                chunk_size: int = 64, impl: str = "auto") -> Float[Array, "B T H V"]:
    """o (B, T, H, V) in q's dtype. w None means w = k (keys against keys); G kv heads divide the H query heads.
    u is cast to v's dtype before the attention (as a KV cache keeps it)."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"deltaformer: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    u = deltaformer_values(k if w is None else w, k, v, beta, segment_ids=segment_ids, scale=scale, mode=mode,
                           chunk_size=chunk_size, impl=impl)
    o = attention(q, k, u.astype(v.dtype), segment_ids=segment_ids, scale=scale, impl=impl)
    return o.astype(q.dtype)
