"""Softmax attention: one entry point, implementations chosen by `impl`.

- "reference": reference.py, the masked softmax written out (the truth the others are tested against);
- "xla": xla.py, the fast XLA forms: dense scores heads first with jax.nn.softmax, or blocked with an
  online softmax and skipped block pairs for long sequences and decode steps against a long cache;
- "pallas": the flash-attention kernels of kernels.pallas_platform(): pallas.py (Triton) on GPU,
  pallas_tpu.py (Mosaic TPU) on TPU; interpret mode on CPU, which is slow and meant for tests;
- "auto": the Pallas kernels on GPU/TPU when kernels.AUTO_PALLAS is set and pallas.supports() the
  call (not decode-sized calls of T <= 16 queries), the XLA forms elsewhere.

The Pallas kernels express every mask of reference.py (causality, segments, and the band of window,
sinks, dilation and growth, each per head or shared) and a `decay` (a logit bias decay_i - kv_decay_j
per head; Forgetting attention's cumulative log forget gate). The band must be static there (Python
numbers or tuples, as the layers give it): a traced band (a calibration loop's candidate masks) runs
the XLA forms whatever `impl` says ("pallas" included), never a wrong result.
"""

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from kernels import check_impl, pallas_platform, use_pallas
from kernels.attention.pallas import BlockSizes, default_block_sizes, flash_attention, supports
from kernels.attention.pallas_tpu import flash_attention_tpu
from kernels.attention.reference import attention_reference, decay_bias, heads_first_decay, visible
from kernels.attention.xla import DENSE_MAX, attention_dense_parts, attention_xla

__all__ = ["attention", "attention_cached", "attention_reference", "attention_xla", "flash_attention",
           "flash_attention_tpu", "write_rows", "BlockSizes", "default_block_sizes"]


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
              causal=True, window=None, scale=None, impl="auto", kv_heads_first=False, sinks=None, dilation=None,
              growth=None, q_doc_positions=None, decay=None, kv_decay=None):
    """q (B, T, H, K), k/v (B, S, G, K|V) with G dividing H -> o (B, T, H, V). See reference.py.
    With kv_heads_first, k/v are (B, G, S, K|V), a KV cache's layout (the XLA forms read it as is).

    scale multiplies the logits q . k; None means K^-1/2. Positions default to the T queries being the
    last T of the S keys; a query sees key j when causal (p_j <= p_i), in the same segment (segment_ids
    for the queries, kv_segment_ids for the keys, defaulting to segment_ids) and in the band of
    `window` (p_j > p_i - window), `dilation`, `growth` and `sinks`, each None, a number or per query
    head (H,), static or traced (reference.py). Sinks and growth count from the queries' positions in
    their documents, q_doc_positions (B|1, T): by default from each document's start for packed
    self-attention (default positions, T = S), else the query positions. A query that sees no key
    returns zeros. decay (B, T, H) / kv_decay
    (B, S, H) float32, kv_decay defaulting to decay: the bias decay_i - kv_decay_j of the logits."""
    check_impl(impl, "attention")
    G = k.shape[1 if kv_heads_first else 2]
    if q.shape[2] % G:
        raise ValueError(f"attention: {G} kv heads do not divide {q.shape[2]} query heads")
    kwargs = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, window=window, scale=scale, decay=decay,
                  kv_decay=kv_decay)
    band = dict(sinks=sinks, dilation=dilation, growth=growth, q_doc_positions=q_doc_positions)
    ks, vs = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if kv_heads_first else (k, v)  # (B, S, G, K)
    flash = all(map(_static, (window, sinks, dilation, growth)))
    if flash and use_pallas(impl, supports(q, ks, vs)):  # (an unused transpose costs nothing: XLA drops it)
        kernel = flash_attention_tpu if pallas_platform() == "tpu" else flash_attention
        return kernel(q, ks, vs, **kwargs, **band)
    if impl == "reference":
        return attention_reference(q, ks, vs, **kwargs, **band)
    return attention_xla(q, k, v, **kwargs, **band, kv_heads_first=kv_heads_first)


def _static(x) -> bool:
    """Whether a band parameter is static (None, a number or a tuple of numbers), as the kernels take it."""
    return all(isinstance(v, numbers.Real) for v in (x if isinstance(x, tuple) else () if x is None else (x,)))


def attention_cached(q, k, v, cache_k, cache_v, *, cache_length, segment_ids=None, cache_segment_ids=None,
                     window=None, scale=None, impl="auto", sinks=None, dilation=None, growth=None,
                     doc_positions=None, cache_positions=None, decay=None, cache_decay=None):
    """A decode step's causal attention: T new queries q (B, T, H, K) with their own keys and values
    k, v (B, T, G, K|V), against a KV cache (B, G, S, K|V), heads first, whose slots [0, cache_length[b])
    hold the earlier tokens of row b (slot s at position s); its new tokens are at positions
    cache_length[b] + [0, T). cache_length is (B,) int32 (a scalar broadcasts): rows may hold
    different numbers of tokens, as after a speculative round that kept more drafts in one row.
    segment_ids (B, T) and cache_segment_ids (B, S) mask across documents. window, sinks, dilation and
    growth are `attention`'s; doc_positions (B, T), the new tokens' positions inside their documents,
    is needed with sinks or growth. decay (B, T, H) is the new tokens' (as queries and as keys),
    cache_decay (B, H, S) float32 the slots' (see `attention`).

    cache_positions (B, S): the position of each slot's token, for a cache whose slots are not in
    position order (a ring buffer, layers/attention.py); a slot whose position is negative or at least
    cache_length[b] is unwritten (or stale, after a rollback) and never seen. Such a cache is never
    written before it is read: long calls attend to the cache and the new keys side by side.

    The same as writing k, v into the cache at cache_length and calling `attention` with those query
    positions, which is what the reference and Pallas impls do. The XLA form instead reads the cache
    as it was before the step, beside the step's own keys (one softmax over both): a decode loop then
    updates the cache in place after reading it, where writing first made XLA on CPU copy the whole
    cache every step (benchmarks/decode.py, GQA at 4K: 2.27 -> 1.46 ms per token with infer/generate.py's
    DECODE_OPTIONS)."""
    B, T = q.shape[:2]
    S = cache_k.shape[2]
    length = jnp.broadcast_to(cache_length, (B,))  # (B,)
    slots = length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # (B, T)
    if segment_ids is None:
        segment_ids, cache_segment_ids = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    band = dict(window=window, sinks=sinks, dilation=dilation, growth=growth)
    doc_positions = slots if doc_positions is None else doc_positions
    written = jnp.arange(S, dtype=jnp.int32)[None] if cache_positions is None else cache_positions
    cache_pos = jnp.where((written >= 0) & (written < length[:, None]), written,
                          jnp.iinfo(jnp.int32).max)  # (B, S): unwritten, unseen
    if impl in ("xla", "auto") and T * S <= DENSE_MAX:  # decode-sized: the dense form
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        own = visible(slots, slots, segment_ids, None, True, *band.values(), doc_positions)
        seen = visible(slots, cache_pos, segment_ids, cache_segment_ids, True, *band.values(), doc_positions)
        parts = [(cache_k, cache_v, seen), (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), own)]
        biases = None
        if decay is not None:
            G = cache_k.shape[1]
            qd = heads_first_decay(decay, G)[..., :, None]  # (B, G, R, T, 1)
            biases = [qd - cache_decay.reshape(B, G, -1, S)[..., None, :], decay_bias(decay, decay, G)]
        return attention_dense_parts(q, parts, scale, biases)
    kw = dict(segment_ids=segment_ids, scale=scale, impl=impl, q_positions=slots, kv_heads_first=True,
              q_doc_positions=doc_positions, decay=decay, **band)
    if cache_positions is not None:  # a ring: the cache beside the new keys, since writing could overwrite
        kc, vc = (jnp.concatenate([c, x.transpose(0, 2, 1, 3)], axis=2) for c, x in ((cache_k, k), (cache_v, v)))
        kv_decay = None if decay is None else jnp.concatenate([cache_decay.transpose(0, 2, 1), decay], axis=1)
        return attention(q, kc, vc, kv_segment_ids=jnp.concatenate([cache_segment_ids, segment_ids], axis=1),
                         kv_positions=jnp.concatenate([cache_pos, slots], axis=1), kv_decay=kv_decay, **kw)
    kc, vc = (write_rows(c, x.transpose(0, 2, 1, 3), length, 2) for c, x in ((cache_k, k), (cache_v, v)))
    seg = write_rows(cache_segment_ids, segment_ids, length, 1)
    kv_decay = None if decay is None else write_rows(cache_decay, decay.transpose(0, 2, 1), length, 2)  # (B, H, S)
    return attention(q, kc, vc, kv_segment_ids=seg, kv_decay=None if decay is None else kv_decay.transpose(0, 2, 1),
                     **kw)


UNROLL_ROWS = 16


def write_rows(cache, new, index, axis: int):
    """`new` written into `cache` along `axis` from slot index[b] in row b (axis 0 is the batch of
    both; index (B,) int32): a KV cache whose rows hold different numbers of tokens.

    One dynamic_update_slice per row, unrolled: XLA updates each in place inside a decode loop,
    where the per-row offsets of a vmapped one become a scatter that XLA on CPU copies the whole
    cache for (7 copies per step in generate's loop at batch 2). Past UNROLL_ROWS rows the unrolled
    program grows too large to compile quickly, and the vmapped form (one copy per step) is used."""
    new = new.astype(cache.dtype)
    if cache.shape[0] > UNROLL_ROWS:
        def one(c, x, i):
            start = [0] * c.ndim
            start[axis - 1] = i
            return lax.dynamic_update_slice(c, x, start)

        return jax.vmap(one)(cache, new, index)
    for b in range(cache.shape[0]):
        start = [b] + [0] * (cache.ndim - 1)
        start[axis] = index[b]
        cache = lax.dynamic_update_slice(cache, new[b:b + 1], start)
    return cache
