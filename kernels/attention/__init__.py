"""Softmax attention: one entry point, implementations chosen by `impl`.

- "reference": reference.py, the masked softmax written out (the truth the others are tested against);
- "xla": xla.py, the fast XLA forms: dense scores heads first with jax.nn.softmax, or blocked with an
  online softmax and skipped block pairs for long sequences and decode steps against a long cache;
- "pallas": the flash-attention kernels of kernels.pallas_platform(): pallas.py (Triton) on GPU,
  pallas_tpu.py (Mosaic TPU) on TPU; interpret mode on CPU, which is slow and meant for tests;
- "auto": the Pallas kernels on GPU/TPU when kernels.AUTO_PALLAS is set and pallas.supports() the
  call (not decode-sized calls of T <= 16 queries); on CPU the fused C++ kernels of cpu.py (cpu.cc, compiled
  on first use) for the training case they take (causal float32 self-attention, documents, GQA, one static
  window, no decay), and for a prefill into empty KV caches (`fresh_caches`); the XLA forms elsewhere.

Every form takes the same arguments: q, k, v, the queries' `segment_ids`, a `Tokens` (masks.py: the
queries' and keys' positions, the keys' documents and decay, where they are not self-attention's), a
`Band` (masks.py: window, sinks, dilation and growth, each per head or shared), `causal`, `scale` and a
`decay` (a logit bias decay_i - kv_decay_j per head; Forgetting attention's cumulative log forget gate).
The Pallas kernels express every mask of reference.py. The band must be static there (Python numbers
or tuples, as the layers give it): a traced band (a calibration loop's candidate masks) runs the XLA
forms whatever `impl` says ("pallas" included), never a wrong result.

Context parallelism (kernels/context.py): self-attention over a sequence split along time over the
mesh's `context` axis runs `context.split_queries`: each device's queries (its own span, or the
zigzag's two chunks: `context_split`) against the keys, values, documents and decay of the whole
sequence, all-gathered, through the forms above with the queries' positions as `Tokens`. The forms skip
key blocks per query block by the block's positions: under the zigzag a device's queries are two chunks
of ceil(T / 2n) tokens, and a query block that straddles them reads the later one's keys.
"""

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels import check_impl, context, pallas_platform, use_pallas
from kernels.attention import cpu
from kernels.attention.masks import Band, CacheView, Tokens
from kernels.attention.pallas import BlockSizes, default_block_sizes, flash_attention, supports
from kernels.attention.pallas_tpu import flash_attention_tpu
from kernels.attention.reference import attention_reference, decay_bias, heads_first_decay, visible
from kernels.attention.xla import DENSE_MAX, attention_dense_parts, attention_xla
from kernels.segments import positions_in_document

__all__ = ["attention", "attention_cached", "fresh_caches", "attention_reference", "attention_xla", "flash_attention",
           "flash_attention_tpu", "write_rows", "Band", "BlockSizes", "CacheView", "Tokens", "default_block_sizes"]


def attention(q, k, v, *, segment_ids=None, tokens: Tokens | None = None, band: Band | None = None, causal=True,
              scale=None, decay=None, impl="auto", kv_heads_first=False, context_split: str = "contiguous"):
    """q (B, T, H, K), k/v (B, S, G, K|V) with G dividing H -> o (B, T, H, V). See reference.py.
    With kv_heads_first, k/v are (B, G, S, K|V), a KV cache's layout (the XLA forms read it as is).

    scale multiplies the logits q . k; None means K^-1/2. Positions default to the T queries being the
    last T of the S keys (`tokens` gives others); a query sees key j when causal (p_j <= p_i), in the
    same segment (segment_ids (B, T) for the queries, tokens.kv_segment_ids for the keys, defaulting to
    segment_ids) and in the `band` (None: every key), whose fields are each a number or per query head
    (H,), static or traced (reference.py). Sinks and growth count from the queries' positions in their
    documents, tokens.q_doc_positions: by default from each document's start for packed self-attention
    (default positions, T = S), else the query positions. A query that sees no key returns zeros.
    decay (B, T, H) / tokens.kv_decay (B, S, H) float32, kv_decay defaulting to decay: the bias
    decay_i - kv_decay_j of the logits.

    Self-attention (no tokens, T = S, keys tokens first) over a sequence split over the context axis
    runs split along time (module docstring), its queries dealt to the devices by context_split, one of
    kernels.context.SPLITS; other calls run whole."""
    check_impl(impl, "attention")
    context.check_split(context_split, "attention")
    G = k.shape[1 if kv_heads_first else 2]
    if q.shape[2] % G:
        raise ValueError(f"attention: {G} kv heads do not divide {q.shape[2]} query heads")
    if tokens is None and not kv_heads_first and k.shape[1] == q.shape[1] and context.active(q.shape[1]):
        return _split_over_context(q, k, v, segment_ids, band, causal, scale, decay, impl, context_split)
    kwargs = dict(segment_ids=segment_ids, tokens=tokens, band=band, causal=causal, scale=scale, decay=decay)
    ks, vs = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if kv_heads_first else (k, v)  # (B, S, G, K)
    flash = band is None or band.is_static()
    if flash and use_pallas(impl, supports(q, ks, vs)):  # (an unused transpose costs nothing: XLA drops it)
        kernel = flash_attention_tpu if pallas_platform() == "tpu" else flash_attention
        return kernel(q, ks, vs, **kwargs)
    if impl == "auto" and cpu.supports(q, k, v, tokens=tokens, band=band, causal=causal, decay=decay,
                                       kv_heads_first=kv_heads_first):
        return cpu.attention_cpu(q, k, v, segment_ids, band, scale)
    if impl == "reference":
        return attention_reference(q, ks, vs, **kwargs)
    return attention_xla(q, k, v, **kwargs, kv_heads_first=kv_heads_first)


def _split_over_context(q, k, v, segment_ids, band, causal, scale, decay, impl, split):
    """`attention`'s self-attention through context.split_queries: the device's queries at their
    positions, against the whole sequence's keys, values, documents (kv_segment_ids) and decay
    (kv_decay); the queries' positions inside their documents counted on the whole sequence. A band's
    traced fields enter the shard_map whole (replicated), its static ones as they are."""
    B, T = q.shape[:2]
    band = Band() if band is None else band
    traced = {f.name: getattr(band, f.name) for f in dataclasses.fields(band)
              if isinstance(getattr(band, f.name), jax.Array)}

    def run(rows, whole, positions, traced):
        (q,), (k, v, seg, kv_decay) = rows, whole
        at = lambda x: None if x is None else x[:, positions]  # the queries' rows of a (B, T, ...) array
        tokens = Tokens(q_positions=positions[None], kv_segment_ids=seg, kv_decay=kv_decay,
                        q_doc_positions=None if seg is None else at(positions_in_document(seg, B, T)))
        return attention(q, k, v, segment_ids=at(seg), tokens=tokens, band=dataclasses.replace(band, **traced),
                         causal=causal, scale=scale, decay=at(kv_decay), impl=impl)

    return context.split_queries(run, (q,), (k, v, segment_ids, decay), traced, split=split)


_FRESH = contextvars.ContextVar("fresh_caches", default=False)


@contextlib.contextmanager
def fresh_caches():
    """While it is open, the caller promises that every `attention_cached` call it traces reads empty caches
    (a prefill into `init_state`'s, as infer.generate's): such a call is its tokens' own self-attention. Not
    a runtime test of the caches' lengths: under lax.cond XLA copied the caches, and chunks into a full one ran
    up to 1.8x slower (64-256 tokens into 4,096 slots, batch 4)."""
    token = _FRESH.set(True)
    try:
        yield
    finally:
        _FRESH.reset(token)


def attention_cached(q, k, v, cache: CacheView, *, segment_ids=None, doc_positions=None, band: Band | None = None,
                     scale=None, decay=None, impl="auto"):
    """A decode step's causal attention: T new queries q (B, T, H, K) with their own keys and values
    k, v (B, T, G, K|V), against a KV cache (masks.CacheView: keys and values (B, G, S, K|V), heads
    first, whose slots [0, cache.length[b]) hold the earlier tokens of row b, slot s at position s); its
    new tokens are at positions cache.length[b] + [0, T). cache.length is (B,) int32 (a scalar
    broadcasts): rows may hold different numbers of tokens, as after a speculative round that kept more
    drafts in one row. segment_ids (B, T) and cache.segment_ids (B, S) mask across documents. The band
    is `attention`'s; doc_positions (B, T), the new tokens' positions inside their documents, is needed
    with sinks or growth. decay (B, T, H) is the new tokens' (as queries and as keys), cache.decay
    (B, H, S) float32 the slots' (see `attention`).

    cache.positions (B, S): the position of each slot's token, for a cache whose slots are not in
    position order (a ring buffer, layers/attention.py); a slot whose position is negative or at least
    cache.length[b] is unwritten (or stale, after a rollback) and never seen. Such a cache is never
    written before it is read: long calls attend to the cache and the new keys side by side.

    The same as writing k, v into the cache at cache.length and calling `attention` with those query
    positions, which is what the reference and Pallas impls do. The XLA form instead reads the cache
    as it was before the step, beside the step's own keys (one softmax over both): a decode loop then
    updates the cache in place after reading it, where writing first made XLA on CPU copy the whole
    cache every step (benchmarks/decode.py, GQA at 4K: 2.27 -> 1.46 ms per token with infer/generate.py's
    DECODE_OPTIONS).

    Traced inside `fresh_caches()` (a prefill from empty caches), the call is its tokens' own self-attention,
    and on CPU runs `attention`'s kernels where they take its mask."""
    B, T = q.shape[:2]
    S = cache.k.shape[2]
    length = jnp.broadcast_to(cache.length, (B,))  # (B,)
    if _FRESH.get() and impl == "auto" and cpu.supports(q, k, v, tokens=None, band=band, causal=True, decay=decay,
                                                        kv_heads_first=False):
        return cpu.attention_cpu(q, k, v, segment_ids, band, scale)
    slots = length[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # (B, T)
    cache_seg = cache.segment_ids
    if segment_ids is None:
        segment_ids, cache_seg = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    doc_positions = slots if doc_positions is None else doc_positions
    written = jnp.arange(S, dtype=jnp.int32)[None] if cache.positions is None else cache.positions
    cache_pos = jnp.where((written >= 0) & (written < length[:, None]), written,
                          jnp.iinfo(jnp.int32).max)  # (B, S): unwritten, unseen
    if impl in ("xla", "auto") and T * S <= DENSE_MAX:  # decode-sized: the dense form
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        own = visible(slots, slots, segment_ids, None, True, band, doc_positions)
        seen = visible(slots, cache_pos, segment_ids, cache_seg, True, band, doc_positions)
        parts = [(cache.k, cache.v, seen), (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), own)]
        biases = None
        if decay is not None:
            G = cache.k.shape[1]
            qd = heads_first_decay(decay, G)[..., :, None]  # (B, G, R, T, 1)
            biases = [qd - cache.decay.reshape(B, G, -1, S)[..., None, :], decay_bias(decay, decay, G)]
        return attention_dense_parts(q, parts, scale, biases)

    def call(kc, vc, **keys):  # `attention` of the queries at their slots against kc, vc (B, G, S', K|V)
        tokens = Tokens(q_positions=slots, q_doc_positions=doc_positions, **keys)
        return attention(q, kc, vc, segment_ids=segment_ids, tokens=tokens, band=band, scale=scale, decay=decay,
                         impl=impl, kv_heads_first=True)

    if cache.positions is not None:  # a ring: the cache beside the new keys, since writing could overwrite
        kc, vc = (jnp.concatenate([c, x.transpose(0, 2, 1, 3)], axis=2) for c, x in ((cache.k, k), (cache.v, v)))
        kv_decay = None if decay is None else jnp.concatenate([cache.decay.transpose(0, 2, 1), decay], axis=1)
        return call(kc, vc, kv_segment_ids=jnp.concatenate([cache_seg, segment_ids], axis=1),
                    kv_positions=jnp.concatenate([cache_pos, slots], axis=1), kv_decay=kv_decay)
    kc, vc = (write_rows(c, x.transpose(0, 2, 1, 3), length, 2) for c, x in ((cache.k, k), (cache.v, v)))
    seg = write_rows(cache_seg, segment_ids, length, 1)
    kv_decay = None if decay is None else write_rows(cache.decay, decay.transpose(0, 2, 1), length, 2)  # (B, H, S)
    return call(kc, vc, kv_segment_ids=seg, kv_decay=None if decay is None else kv_decay.transpose(0, 2, 1))


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
