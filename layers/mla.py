"""Multi-head latent attention (MLA; DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, section 2.1): the
keys and values of every head come from one shared low-rank latent, beside a decoupled rotary key shared
by the heads, so decoding caches L + R numbers per token instead of a KV cache's 2 x G x K.

    c_kv = RMSNorm(x W_DKV)                          (B, T, L)     L = kv_lora_rank (the paper's d_c)
    k^C_h = c_kv W_UK_h,   v_h = c_kv W_UV_h         (B, T, H, K), (B, T, H, V)   K = head_dim (d_h), V = v_head_dim
    k^R = RoPE(x W_KR)                               (B, T, R)     R = rope_dim (d_h^R), one for all heads
    c_q = RMSNorm(x W_DQ)                            (B, T, Lq)    Lq = q_lora_rank (d_c'); null: c_q = x, no norm
    [q^C_h ; q^R_h] = c_q W_UQ_h,   q^R_h <- RoPE(q^R_h)
    o_h = sum_j softmax_j(s [q^C_h ; q^R_h] . [k^C_hj ; k^R_j]) v_hj,   y = [o_1 .. o_H] W_O

with s = (K + R)^-1/2. Code names: wdq (W_DQ; None when q_lora_rank is null), wuq (W_UQ, or W_Q on x
itself), wdkv, wkr, wuk, wuv, wo; `latent` is [c_kv ; k^R] (B, T, L + R). The training path
(`__call__`) is ordinary attention of q, k of width K + R and values of width V through
kernels.attention.attention (the Pallas flash kernels where picked).

Decoding caches only the latent of each token, LatentCache.kv (B, S, L + R). With `absorb` (the
default) no key or value of a head is ever made: q^C_h . k^C_hj = (q^C_h W_UK_h^T) . c_kv_j, so each
head's query moves into latent space, q~_h = [q^C_h W_UK_h^T ; q^R_h] (L + R), and the cache rows are
the keys: MQA with one kv head of width L + R (kernels.attention.attention_cached, G = 1). The cache
rows are the values too: o~_h = sum_j p_hj [c_kv_j ; k^R_j], o_h = o~_h[:L] W_UV_h (the R channels
of k^R in o~_h are dropped). Passing the one cache array as keys and as values stores and reads c_kv
once, with no slice copy, at the price of R extra value channels per head (R / L of that product).
W_UK and W_UV are applied to the query and to o~ per token rather than multiplied into W_UQ and W_O
(the paper's "absorbed" matrices): the same numbers up to rounding, and cheaper for a few tokens than
the (Lq, H, L) and (H, L, D) products every call. `absorb=False` is the naive decode, the reference
the tests hold it to: k and v of every head expanded from the whole cache, then ordinary attention.

Like layers/attention.py: the cache's slot s holds the token at step s of its row with its running
document number (packed or left-padded rows never attend across a document start), rotary positions
count inside a document, each row has its own index (B,) for speculative rollback, and past the
trained context `long_context` "window" (the default) lets a query see only the last max_seq_len
tokens, "full" every earlier one; `window` is a sliding window (the smaller holds).

`rope_scaling` (layers/rotary.py: linear, llama3 or yarn) stretches the rotary of q^R and k^R for a
longer context, as Attention's; with yarn and its mscale_all_dim, s is also multiplied by
mscale(factor, mscale_all_dim)^2 (mscale(f, m) = 0.1 m ln f + 1 for f > 1), DeepSeek-V2/V3's YaRN
(transformers' yarn_apply_mscale). Dynamic NTK is refused (it changes with the running length).
`rotary=False` leaves q^R and k^R unrotated (NoPE: Kimi Linear's MLA; the shared R channels stay).

Departures from DeepSeek-V2: rotary in the rotate-half layout of layers/rotary.py where DeepSeek's
checkpoints rotate interleaved pairs (a fixed permutation of the rotary columns of W_UQ and W_KR: the
same functions; zoo/hf/deepseek.py permutes them); W_DKV and W_KR are two parameters (DeepSeek's
kv_a_proj_with_mqa is them side by side), and so are W_UK and W_UV (its kv_b_proj); no biases.
Parameters carry their logical sharding axes: heads over `tensor`, the model width over `fsdp`, the
latents whole.
"""

import math
from typing import Annotated

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kernels import check_impl, context
from kernels.attention import Band, CacheView, attention, attention_cached, write_rows
from kernels.segments import document_index, positions_in_document
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import ContextSplit, Impl, OneOf, PosFloat, PosInt
from layers.rotary import RopeScaling, apply_rotary
from layers.sharding import axes, constrain
from layers.state import cache_counters, empty_cache, state


def yarn_softmax_factor(scaling: RopeScaling | None) -> float:
    """DeepSeek's YaRN factor on the softmax scale: mscale(factor, mscale_all_dim)^2, 1 without it."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim or scaling.factor <= 1:
        return 1.0
    return (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0) ** 2


# A stepped cache keeps its slots once (final): a row never reads past its index.
@state(final=("kv", "doc"))
class LatentCache:
    kv: Float[Array, "B S _LR"]  # (B, S, L + R): each slot's [c_kv ; k^R], in the compute dtype
    doc: Int[Array, "B S"]  # (B, S) int32: document number of the token in each slot
    cur_doc: Int[Array, " B"]  # (B,) int32: document number of the last token written
    pos: Int[Array, " B"]  # (B,) int32: position in its document of the next token
    index: Int[Array, " B"]  # (B,) int32: each row's next slot to write; past S it flags an overflow

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row decoded more tokens than the cache has slots (as KVCache.overflowed)."""
        return jnp.any(self.index > self.kv.shape[1])


class MultiHeadLatentAttention(SequenceMixer):
    """Multi-head latent attention (DeepSeek-V2 2024): every head's keys and values from one shared latent of width
    kv_lora_rank (None = 4 head_dim) and a rotary key of width rope_dim (None = head_dim / 2, even) shared by the heads,
    so decoding caches kv_lora_rank + rope_dim numbers per token; head_dim: a head's key width besides the rotary part
    (None = d_model / num_heads); v_head_dim: its value width (None = head_dim); q_lora_rank: queries through a
    normalised latent of that width (None = one projection); absorb: decode with W_UK folded into the query and W_UV
    into the output (False = keys and values expanded from the cache, the reference); window, long_context, rope_base,
    norm_eps as Attention's (norm_eps: the latents' RMSNorms); rope_scaling: the rotary's scaling for a longer context
    (linear, llama3 or yarn, whose mscale_all_dim also scales the softmax as DeepSeek's); rotary: False = no rotary on
    the rope_dim channels (NoPE, Kimi Linear); context_split ("contiguous" | "zigzag"): with a sequence split over the
    mesh's context axis, which queries each device runs, as Attention's; impl ("auto" | "reference" | "xla" |
    "pallas") picks the op's implementation on every path; dtype: the compute dtype (parameters stay float32)."""
    grows_with_context = True  # the cache holds max_len slots, of L + R numbers each
    context_parallel = True  # kernels.attention's form split over the context axis; the rest is per token

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None,
                 v_head_dim: PosInt | None = None, rope_dim: PosInt | None = None, kv_lora_rank: PosInt | None = None,
                 q_lora_rank: PosInt | None = None, window: PosInt | None = None, rope_base: PosFloat = 10000.0,
                 rope_scaling: RopeScaling | None = None, rotary: bool = True, norm_eps: PosFloat = 1e-6,
                 long_context: Annotated[str, OneOf("window", "full")] = "window",
                 absorb: bool = True, max_seq_len: int | None = None, context_split: ContextSplit = "contiguous",
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        check_impl(impl, "MultiHeadLatentAttention")
        context.check_split(context_split, "MultiHeadLatentAttention")
        if long_context not in ("window", "full"):
            raise ValueError(f"long_context={long_context!r}; expected 'window' or 'full'")
        if num_heads < 1 or head_dim is None and d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} must be positive and divide d_model={d_model} (or give head_dim)")
        given = dict(head_dim=head_dim, v_head_dim=v_head_dim, rope_dim=rope_dim, kv_lora_rank=kv_lora_rank,
                     q_lora_rank=q_lora_rank, window=window, max_seq_len=max_seq_len)
        for name, n in given.items():
            if n is not None and n < 1:
                raise ValueError(f"{name}={n}; expected a positive number or None")
        K = d_model // num_heads if head_dim is None else head_dim
        V = K if v_head_dim is None else v_head_dim
        R = K // 2 if rope_dim is None else rope_dim  # DeepSeek-V2: K = 128, R = 64, L = 512
        L = 4 * K if kv_lora_rank is None else kv_lora_rank
        if R < 2 or R % 2:
            raise ValueError(f"rope_dim={R}; expected an even number >= 2 (the rotary turns pairs of channels"
                             + ("; head_dim / 2 is its default)" if rope_dim is None else ")"))
        if rope_scaling is not None and not rotary:
            raise ValueError("rope_scaling: set with rotary=False, which turns nothing")
        if rope_scaling is not None and rope_scaling.type == "dynamic":
            raise ValueError("rope_scaling: type 'dynamic' is not supported by mla (its frequencies follow the "
                             "running length); expected linear, llama3 or yarn")
        H, Lq = num_heads, q_lora_rank
        self.d_model, self.num_heads, self.head_dim, self.v_head_dim = d_model, H, K, V
        self.rope_dim, self.kv_lora_rank, self.q_lora_rank = R, L, Lq
        if long_context == "window" and max_seq_len is not None:
            window = max_seq_len if window is None else min(window, max_seq_len)
        self.window, self.rope_base, self.absorb, self.impl, self.dtype = window, rope_base, absorb, impl, dtype
        self.rope_scaling, self.rotary, self.context_split = rope_scaling, rotary, context_split
        self.scale = (K + R) ** -0.5 * yarn_softmax_factor(rope_scaling)  # DeepSeek's: the width of a head's q . k
        param = lambda shape, *names: nnx.Param(nnx.initializers.normal(shape[0] ** -0.5)(rngs.params(), shape),
                                                **axes(*names))
        if Lq is None:
            self.wdq, self.q_norm, self.wuq = None, None, param((d_model, H, K + R), "embed", "heads", None)
        else:
            self.wdq, self.q_norm = param((d_model, Lq), "embed", None), RMSNorm(Lq, eps=norm_eps)
            self.wuq = param((Lq, H, K + R), None, "heads", None)
        self.wdkv, self.kv_norm = param((d_model, L), "embed", None), RMSNorm(L, eps=norm_eps)
        self.wkr = param((d_model, R), "embed", None)
        self.wuk, self.wuv = param((L, H, K), None, "heads", None), param((L, H, V), None, "heads", None)
        self.wo = nnx.Param(nnx.initializers.normal((H * V) ** -0.5)(rngs.params(), (H, V, d_model)),
                            **axes("heads", None, "embed"))

    def _w(self, p):
        return p[...].astype(self.dtype)

    def _queries(self, x, positions):
        """q^C (B, T, H, K) and the rotated q^R (B, T, H, R)."""
        c = x if self.wdq is None else self.q_norm(project(x, self._w(self.wdq)))  # (B, T, D | Lq)
        q = constrain(project(c, self._w(self.wuq)), ("batch", "length", "heads", None))  # (B, T, H, K + R)
        K = self.head_dim
        return q[..., :K], self._rotary(q[..., K:], positions)

    def _rotary(self, x, positions):
        return apply_rotary(x, positions, self.rope_base, self.rope_scaling) if self.rotary else x

    def _latent(self, x, positions):
        """[c_kv ; k^R] (B, T, L + R): what the cache keeps of each token."""
        c = self.kv_norm(project(x, self._w(self.wdkv)))  # (B, T, L)
        kr = self._rotary(project(x, self._w(self.wkr))[:, :, None], positions)  # (B, T, 1, R)
        return jnp.concatenate([c, kr[:, :, 0]], axis=-1)

    def _expand(self, latent):
        """Every head's keys [k^C_h ; k^R] (B, S, H, K + R) and values (B, S, H, V) from latents (B, S, L + R)."""
        L, H = self.kv_lora_rank, self.num_heads
        c, kr = latent[..., :L], latent[..., L:]
        kc = project(c, self._w(self.wuk))  # (B, S, H, K)
        k = jnp.concatenate([kc, jnp.broadcast_to(kr[:, :, None], (*kr.shape[:2], H, self.rope_dim))], axis=-1)
        return constrain(k, ("batch", "length", "heads", None)), project(c, self._w(self.wuv))

    def _out(self, o):
        B, T, H, V = o.shape
        return project(o.reshape(B, T, H * V), self._w(self.wo).reshape(H * V, -1))  # (B, T, D)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        x, positions = x.astype(self.dtype), positions_in_document(segment_ids, B, T)
        qc, qr = self._queries(x, positions)
        k, v = self._expand(self._latent(x, positions))
        doc = None if segment_ids is None else document_index(segment_ids, B, T)  # ids may repeat: number them
        o = attention(jnp.concatenate([qc, qr], axis=-1), k, v, segment_ids=doc, band=Band(window=self.window),
                      scale=self.scale, impl=self.impl, context_split=self.context_split)
        return self._out(o)

    def init_state(self, batch_size: int, max_len: int) -> LatentCache:
        return LatentCache(kv=jnp.zeros((batch_size, max_len, self.kv_lora_rank + self.rope_dim), self.dtype),
                           **empty_cache(batch_size, max_len))

    def decode(self, x: Float[Array, "B T D"], cache: LatentCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """Absorbed (self.absorb) or naive decode; steps=True returns the cache after every token, for
        `rollback`, as layers/attention.py does (index, pos, cur_doc per step; the slots as written)."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        L = self.kv_lora_rank
        self._check_room(cache.index, T, cache.kv.shape[1])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = cache.cur_doc[:, None] + document_index(segment_ids, B, T)  # (B, T)
        x = x.astype(self.dtype)
        qc, qr = self._queries(x, positions)
        new = self._latent(x, positions)  # (B, T, L + R)
        masks = dict(segment_ids=doc, band=Band(window=self.window), scale=self.scale, impl=self.impl)
        view = lambda k, v: CacheView(k, v, cache.index, cache.doc)  # keys, values (B, G, S, K|V)
        if self.absorb:
            q = jnp.concatenate([jnp.einsum("BTHK,LHK->BTHL", qc, self._w(self.wuk)), qr], axis=-1)  # (B, T, H, L + R)
            kv, ckv = new[:, :, None], cache.kv[:, None]  # (B, T, 1, L + R), (B, 1, S, L + R): keys and values
            o = attention_cached(q, kv, kv, view(ckv, ckv), **masks)[..., :L]  # (B, T, H, L)
            o = jnp.einsum("BTHL,LHV->BTHV", o, self._w(self.wuv))
        else:
            (k, v), (ck, cv) = self._expand(new), self._expand(cache.kv)  # (B, T|S, H, K + R | V)
            o = attention_cached(jnp.concatenate([qc, qr], axis=-1), k, v,
                                 view(ck.transpose(0, 2, 1, 3), cv.transpose(0, 2, 1, 3)), **masks)
        # Written after the read: XLA then updates the cache in place.
        slots = dict(kv=write_rows(cache.kv, new, cache.index, 1), doc=write_rows(cache.doc, doc, cache.index, 1))
        counters = cache_counters(cache.index, doc, positions, steps)
        return self._out(o), (LatentCache.stepped if steps else LatentCache)(**slots, **counters)
