"""Softmax attention mixer: MHA, GQA and MQA (Ainslie et al., 2023), rotary positions, optional
sliding window, and a fixed-shape KV cache for decoding.

num_kv_heads == num_heads is MHA, 1 is MQA, anything dividing num_heads in between is GQA. The cache
holds only the kv heads, heads first: (B, G, S, K) for K and for V. Slot s of the cache holds the token at
absolute step s of the row, so a causal/window mask on slot indices is exact; each slot also keeps
the running document number of its token, so packed or left-padded rows never attend across a
document start. Rotary positions count inside a document, so a packed document gets the same
positions as when run alone.

Past the trained context (`max_seq_len`, given by the model: the longest sequence it was trained
on), `long_context` decides: "window" (the default) lets each query see only the last max_seq_len
tokens, so no query ever meets a rotary distance it was not trained on (within the trained context
this is exactly full causal attention); "full" lets it see every earlier token (extrapolation to
distances it never saw: text degrades quickly past the trained length). With `window` set, the
smaller of the two windows holds. max_seq_len=None means no trained context is known: full.

Options of the Hugging Face families (zoo/hf.py): `rope_scaling` (layers/rotary.py: linear, llama3,
yarn, dynamic; under dynamic a forward pass or KV cache longer than its original_max_position_embeddings
is refused, the one range where a fixed rotary equals transformers' dynamic NTK), `qkv_bias` (Qwen2:
biases on the q, k, v projections), `qk_norm` (Qwen3: an RMSNorm over each head's query and key, eps
`norm_eps`, before the rotary).

Parameters carry their logical sharding axes (layers/sharding.py): the query heads and kv heads over
`tensor`, the model width over `fsdp`.

`kv_cache` (read by init_state; infer/quantize.py sets it) picks the cache's storage: None keeps k and
v in the compute dtype; "int8" keeps int8 codes with a float32 scale per (row, kv head, slot), written
quantized and read dequantized (layers/quant.py): a quarter of float32's bytes plus 4 / K.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, Int8

from kernels import check_impl
from kernels.attention import attention, attention_cached, write_rows
from kernels.segments import document_starts, positions_in_document
from layers.linear import project
from layers.norm import RMSNorm
from layers.quant import quantize_rows
from layers.rotary import RopeScaling, apply_rotary
from layers.shapes import check_input
from layers.sharding import axes, constrain
from layers.state import check_steps, rollback, state


# A stepped cache keeps its slots once (final): a row never reads past its index.
@state(final=("k", "v", "doc", "k_scale", "v_scale"))
class KVCache:
    # (B, G, S, K): heads first, the layout a decode step reads without a copy; int8 codes with k_scale
    k: Float[Array, "B G S K"] | Int8[Array, "B G S K"]
    v: Float[Array, "B G S K"] | Int8[Array, "B G S K"]  # (B, G, S, K)
    doc: Int[Array, "B S"]  # (B, S) int32: document number of the token in each slot
    cur_doc: Int[Array, " B"]  # (B,) int32: document number of the last token written
    pos: Int[Array, " B"]  # (B,) int32: position in its document of the next token
    index: Int[Array, " B"]  # (B,) int32: each row's next slot to write; past S it flags an overflow
    k_scale: Float[Array, "B G S 1"] | None = None  # (B, G, S, 1) float32 for an int8 cache, else None
    v_scale: Float[Array, "B G S 1"] | None = None  # (B, G, S, 1)

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row decoded more tokens than the cache has slots (later ones overwrote the last
        slot): eager decode raises instead, but under jit nothing can, so callers check this."""
        return jnp.any(self.index > self.k.shape[2])


def _store(x, int8: bool):
    """New keys or values (B, T, G, K) as the cache keeps them: (x, None), or int8 codes and (B, T, G, 1) scales."""
    return quantize_rows(x) if int8 else (x, None)


def _load(c, scale, dtype):
    """The cache's keys or values in `dtype`: an int8 cache's codes times their scales."""
    return c.astype(dtype) if scale is None else (c.astype(jnp.float32) * scale).astype(dtype)


def _documents(segment_ids, B, T, start):
    """Running document number per token: `start` for token 0, +1 at each document start."""
    if segment_ids is None:
        return jnp.broadcast_to(start[:, None], (B, T))
    return start[:, None] + jnp.cumsum(document_starts(segment_ids), axis=1, dtype=jnp.int32)


class Attention(nnx.Module):
    grows_with_context = True  # the KV cache holds max_len slots (every other mixer's state is fixed)
    kv_cache = None  # the cache's storage, read by init_state: None (compute dtype) or "int8"

    def __init__(self, d_model: int, *, num_heads: int = 4, num_kv_heads: int | None = None,
                 head_dim: int | None = None, window: int | None = None, rope_base: float = 10000.0,
                 rope_scaling: RopeScaling | None = None, qkv_bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-6, long_context: str = "window", max_seq_len: int | None = None,
                 impl: str = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        check_impl(impl, "Attention")
        if long_context not in ("window", "full"):
            raise ValueError(f"long_context={long_context!r}; expected 'window' or 'full'")
        if window is not None and window < 1 or max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"window={window} and max_seq_len={max_seq_len} must be positive or None")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None and d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
        H, G, K = num_heads, num_kv_heads, head_dim or d_model // num_heads
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        if long_context == "window" and max_seq_len is not None:
            window = max_seq_len if window is None else min(window, max_seq_len)
        self.window, self.rope_base, self.impl, self.dtype = window, rope_base, impl, dtype  # the window in force
        self.rope_scaling = rope_scaling
        self.exact_up_to = rope_scaling.original_max_position_embeddings \
            if rope_scaling is not None and rope_scaling.type == "dynamic" else None
        init = nnx.initializers.normal(d_model ** -0.5)
        self.wq = nnx.Param(init(rngs.params(), (d_model, H, K)), **axes("embed", "heads", None))
        self.wk = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wv = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wo = nnx.Param(nnx.initializers.normal((H * K) ** -0.5)(rngs.params(), (H, K, d_model)),
                            **axes("heads", None, "embed"))
        zeros = lambda n, name: nnx.Param(jnp.zeros((n, K), jnp.float32), **axes(name, None))
        self.bq, self.bk, self.bv = (zeros(H, "heads"), zeros(G, "kv_heads"), zeros(G, "kv_heads")) if qkv_bias \
            else (None, None, None)
        self.q_norm, self.k_norm = (RMSNorm(K, eps=norm_eps), RMSNorm(K, eps=norm_eps)) if qk_norm else (None, None)

    def _qkv(self, x, positions):
        x = x.astype(self.dtype)
        q, k, v = (project(x, w[...].astype(self.dtype)) for w in (self.wq, self.wk, self.wv))  # (B, T, H|G, K)
        if self.bq is not None:
            q, k, v = (a + b[...].astype(self.dtype) for a, b in zip((q, k, v), (self.bq, self.bk, self.bv)))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # On a mesh: heads split over `tensor`, rows over the batch axes (no-op on one device).
        q = constrain(q, ("batch", None, "heads", None))
        k, v = (constrain(a, ("batch", None, "kv_heads", None)) for a in (k, v))
        rotary = lambda a: apply_rotary(a, positions, self.rope_base, self.rope_scaling)
        return rotary(q), rotary(k), v

    def _out(self, o):
        B, T, H, K = o.shape
        return project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)

    def _check_length(self, n: int, what: str):
        if self.exact_up_to is not None and n > self.exact_up_to:
            raise ValueError(f"Attention: {what} of {n} tokens exceeds {self.exact_up_to}, the context where dynamic "
                             "rope scaling is the plain rotary (past it transformers re-derives the frequencies from "
                             "the running length, which this layer cannot match); keep within it")

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        check_input(x, self.d_model, segment_ids, "Attention")
        B, T, _ = x.shape
        self._check_length(T, "a sequence")
        q, k, v = self._qkv(x, positions_in_document(segment_ids, B, T))
        doc = None if segment_ids is None else _documents(segment_ids, B, T, jnp.zeros((B,), jnp.int32))
        return self._out(attention(q, k, v, segment_ids=doc, window=self.window, impl=self.impl))

    def init_state(self, batch_size: int, max_len: int) -> KVCache:
        self._check_length(max_len, "a KV cache")
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        zeros = jnp.zeros((batch_size,), jnp.int32)
        if self.kv_cache not in (None, "int8"):
            raise ValueError(f"Attention.kv_cache={self.kv_cache!r}; expected None or 'int8'")
        int8 = self.kv_cache == "int8"
        scale = (lambda: jnp.zeros((*shape[:3], 1), jnp.float32)) if int8 else (lambda: None)
        return KVCache(k=jnp.zeros(shape, jnp.int8 if int8 else self.dtype),
                       v=jnp.zeros(shape, jnp.int8 if int8 else self.dtype),
                       doc=jnp.full((batch_size, max_len), -1, jnp.int32), cur_doc=zeros, pos=zeros,
                       index=zeros, k_scale=scale(), v_scale=scale())

    def decode(self, x: Float[Array, "B T D"], cache: KVCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback` (layers/state.py): index, pos
        and cur_doc per step, (T, B); the slots as written, since a rolled-back row masks the slots
        past its index as unwritten and its next decode overwrites them."""
        check_input(x, self.d_model, segment_ids, "Attention.decode")
        check_steps(steps, segment_ids, "Attention.decode")
        B, T, _ = x.shape
        S = cache.k.shape[2]
        if not isinstance(cache.index, jax.core.Tracer) and (n := int(np.max(cache.index))) + T > S:
            raise ValueError(f"decode: {n} cached + {T} new tokens exceed max_len={S}")
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = _documents(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v = self._qkv(x, positions)
        ck, cv = _load(cache.k, cache.k_scale, self.dtype), _load(cache.v, cache.v_scale, self.dtype)  # (B, G, S, K)
        o = attention_cached(q, k, v, ck, cv, cache_length=cache.index, segment_ids=doc, cache_segment_ids=cache.doc,
                             window=self.window, impl=self.impl)
        # Written after the read: XLA then updates the cache in place.
        write = lambda c, a: None if c is None else write_rows(c, a.transpose(0, 2, 1, 3), cache.index, 2)
        (k, k_scale), (v, v_scale) = (_store(a, cache.k_scale is not None) for a in (k, v))
        slots = dict(k=write(cache.k, k), v=write(cache.v, v), doc=write_rows(cache.doc, doc, cache.index, 1),
                     k_scale=write(cache.k_scale, k_scale), v_scale=write(cache.v_scale, v_scale))
        if steps:
            after = jnp.arange(1, T + 1, dtype=jnp.int32)[:, None]  # (T, 1)
            return self._out(o), KVCache.stepped(**slots, cur_doc=doc.T, pos=(positions + 1).T,
                                                 index=cache.index + after)  # (T, B) each
        return self._out(o), KVCache(**slots, cur_doc=doc[:, -1], pos=positions[:, -1] + 1, index=cache.index + T)

    def rollback(self, stepped: KVCache, drop: Int[Array, " B"]) -> KVCache:
        return rollback(stepped, drop)
