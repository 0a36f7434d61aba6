"""Softmax attention mixer: MHA, GQA and MQA (Ainslie et al., 2023), rotary positions, optional
sliding window, static sparse masks, and a fixed-shape KV cache for decoding.

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

Options of the Hugging Face families (zoo/hf): `rope_scaling` (layers/rotary.py: linear, llama3,
yarn, dynamic; under dynamic a forward pass or KV cache longer than its original_max_position_embeddings
is refused, the one range where a fixed rotary equals transformers' dynamic NTK), `qkv_bias` (Qwen2:
biases on the q, k, v projections), `qk_norm` (Qwen3: an RMSNorm over each head's query and key, eps
`norm_eps`, before the rotary), `out_bias` (RecurrentGemma: a bias bo (D,) on the output projection).

Parameters carry their logical sharding axes (layers/sharding.py): the query heads and kv heads over
`tensor`, the model width over `fsdp`.

Static sparse masks (kernels/attention/reference.py gives the exact rule): `sinks`, the first tokens
of each document that every later query of it sees (StreamingLLM, Xiao et al., 2024); `dilation`, a
window of `window` keys every dilation-th token (Longformer, Beltagy et al., 2020); `head_masks`, one
HeadMask per query head (window, sinks, dilation, growth: SemSA / MoA's per-head spans alpha + beta N,
Fu et al., 2024, with alpha = window * dilation, beta = growth and N the query's position in its
document + 1), instead of the three options for every head. Past the trained context the
long_context="window" rule narrows each head's window to span at most max_seq_len tokens; a growing
head (growth > 0) is not narrowed. Departure from StreamingLLM: the rotary positions stay the tokens'
positions in their document (StreamingLLM renumbers the cache's slots to run models trained without
sinks past their context), so decoding equals the training pass exactly, and a model meant to run far
past max_seq_len is trained with its sinks.

Ring-buffer cache: when every head's band is bounded, an explicit `window` (not only long_context's)
and no growth, init_state ignores max_len and keeps `sinks` slots for the first tokens of the current
document plus a ring of window * dilation + ring_spare slots written cyclically (slot = sinks + index
mod ring), each slot with the index of its token (`KVCache.token_index`): the cache's bytes and a
decode step's cost stay constant however long the context. A decode call reads the cache before it
writes it (a prefill longer than the ring attends to the cache and its own keys side by side), and
writes only the last document's first tokens and its last `ring` tokens. A rollback (speculative
decoding) leaves the slots a verify pass of T tokens wrote, whose tokens are past the row's index
and unseen; those T slots overwrote tokens at least ring - T + 1 back, out of every window when
ring_spare >= T: decode(steps=True) refuses a longer call. Growing heads keep the full cache.

`kv_cache` (read by init_state; infer/quantize.py sets it) picks the cache's storage: None keeps k and
v in the compute dtype; "int8" keeps int8 codes with a float32 scale per (row, kv head, slot), written
quantized and read dequantized (layers/quant.py): a quarter of float32's bytes plus 4 / K.

Options of the 2025-2026 hybrids (docs/families/attention.md has the symbol map and the checkpoints' layouts):
- `output_gate` (Qiu et al. 2025, arXiv 2505.06708; Qwen3-Next): o_h <- o_h ⊙ σ(x W_g) before W_o, W_g (D, H)
  ("head", one gate per head) or (D, H, K) ("channel"). Qwen3-Next's q_proj (D -> H * 2K) holds per head
  [query (K) | gate (K)]: its weight, transposed and viewed (D, H, 2K), is [wq | w_out_gate] on the last axis.
- `rope_fraction` (transformers' partial_rotary_factor): the rotary on the first int(K * rope_fraction) dims of
  each head only (layers/rotary.py), with rope_scaling's frequencies over those dims; 0: no rotary at all, the
  attention layers of Jamba and Nemotron-H, which take their order from the recurrent layers beside them
  (no positional encoding: the layer sees its keys as a set, masked causally).
- `differential` (Ye et al. 2024, Differential Transformer, arXiv 2410.05258): head h's query and key are
  two halves of K/2 = d dims, [Q1 | Q2] and [K1 | K2]; its value keeps all K = 2d dims, and
      o_h = (1 - λ_init) RMSNorm_w((softmax(Q1 K1^T / √d) - λ softmax(Q2 K2^T / √d)) V),
      λ = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init,   λ_init = 0.8 - 0.6 exp(-0.3 layer_id),
  with the model's 0-based layer_id (the paper's l - 1); λq1, λk1, λq2, λk2 (d,) ~ N(0, 0.1²) shared by the
  layer's heads; RMSNorm over each head's K dims with a weight (eps 1e-5), as the official code's subln. Each
  half gets the rotary of d dims (and qk_norm an RMSNorm of d dims). The op runs twice, on (Q1, K1, V) and
  (Q2, K2, V), so every impl, mask, the KV cache (K holds [K1 | K2]) and its ring buffer work unchanged.
  Departures: the official code rotates interleaved pairs (a fixed permutation of each half's dims); under
  GQA it repeats the 2G key halves as if they were kv heads, so for num_heads / num_kv_heads > 1 both
  halves of head h meet key half (2h + s) // n_rep, where here half s meets half s of the head's kv group
  (the two agree for MHA); transformers' DiffLlama splits heads half-major and has no norm weight.
"""

import dataclasses
import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, Int8

from kernels import check_impl, context
from kernels.attention import Band, CacheView, attention, attention_cached, write_rows
from kernels.segments import document_index, positions_in_document
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import ContextSplit, Impl, NonNegFloat, NonNegInt, OneOf, PosFloat, PosInt, Range
from layers.quant import quantize_rows
from layers.rotary import RopeScaling, apply_rotary
from layers.shapes import head_shape
from layers.sharding import axes, constrain
from layers.state import cache_counters, empty_cache, state


@dataclasses.dataclass(frozen=True)
class HeadMask:
    """attention.head_masks[h]: query head h's band: window (None = every earlier token), sinks, dilation,
    growth (the window grows by growth tokens per token of the document); sinks 0, dilation 1, growth 0 = none."""
    window: PosInt | None = None
    sinks: NonNegInt = 0
    dilation: PosInt = 1
    growth: NonNegFloat = 0.0


# A stepped cache keeps its slots once (final): a row never reads past its index.
@state(final=("k", "v", "doc", "k_scale", "v_scale", "token_index"))
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
    token_index: Int[Array, "B S"] | None = None  # (B, S) int32, a ring buffer: the index of each slot's token, -1 none

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row decoded more tokens than the cache has slots (later ones overwrote the last
        slot): eager decode raises instead, but under jit nothing can, so callers check this. A ring
        buffer never overflows."""
        return jnp.any(self.index > self.k.shape[2]) & (self.token_index is None)


def _store(x, int8: bool):
    """New keys or values (B, T, G, K) as the cache keeps them: (x, None), or int8 codes and (B, T, G, 1) scales."""
    return quantize_rows(x) if int8 else (x, None)


def _load(c, scale, dtype):
    """The cache's keys or values in `dtype`: an int8 cache's codes times their scales."""
    return c.astype(dtype) if scale is None else (c.astype(jnp.float32) * scale).astype(dtype)


def _head_masks(H: int, window, sinks: int, dilation: int, head_masks, ring_spare: int) -> list[HeadMask]:
    """Each query head's HeadMask, from head_masks or from the options shared by every head, checked."""
    if head_masks is None:
        head_masks = [HeadMask(window, sinks, dilation)] * H
    elif (window, sinks, dilation) != (None, 0, 1):
        raise ValueError("Attention: give window, sinks and dilation for every head or per head in head_masks, "
                         f"not both (window={window}, sinks={sinks}, dilation={dilation})")
    elif len(head_masks) != H:
        raise ValueError(f"Attention.head_masks: {len(head_masks)} masks for num_heads={H}; expected one per head")
    for h, m in enumerate(head_masks):
        where = "Attention" if len(set(head_masks)) == 1 else f"Attention.head_masks[{h}]"
        if m.window is not None and m.window < 1 or m.sinks < 0 or m.dilation < 1 or m.growth < 0:
            raise ValueError(f"{where}: window={m.window}, sinks={m.sinks}, dilation={m.dilation}, growth={m.growth}; "
                             "expected a window >= 1 or None, sinks >= 0, dilation >= 1, growth >= 0")
        if m.growth and m.window is None:
            raise ValueError(f"{where}: growth={m.growth} grows a window, and there is none (window=None)")
    if ring_spare < 1:
        raise ValueError(f"Attention: ring_spare={ring_spare}; expected >= 1")
    return list(head_masks)


def make_projections(layer, d_model: int, H: int, G: int, K: int, qkv_bias: bool, rngs: nnx.Rngs):
    """The projections of a softmax-attention-like layer, with their sharding axes: wq (D, H, K), wk, wv
    (D, G, K), wo (H, K, D), and with qkv_bias the biases bq (H, K), bk, bv (G, K) (else None)."""
    init = nnx.initializers.normal(d_model ** -0.5)
    layer.wq = nnx.Param(init(rngs.params(), (d_model, H, K)), **axes("embed", "heads", None))
    layer.wk = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
    layer.wv = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
    layer.wo = nnx.Param(nnx.initializers.normal((H * K) ** -0.5)(rngs.params(), (H, K, d_model)),
                         **axes("heads", None, "embed"))
    zeros = lambda n, name: nnx.Param(jnp.zeros((n, K), jnp.float32), **axes(name, None))
    layer.bq, layer.bk, layer.bv = (zeros(H, "heads"), zeros(G, "kv_heads"), zeros(G, "kv_heads")) if qkv_bias \
        else (None, None, None)


def project_qkv(layer, x: Float[Array, "B T D"]):
    """q (B, T, H, K), k, v (B, T, G, K) from `make_projections`' weights (and biases), in layer.dtype."""
    x = x.astype(layer.dtype)
    q, k, v = (project(x, w[...].astype(layer.dtype)) for w in (layer.wq, layer.wk, layer.wv))
    if layer.bq is not None:
        q, k, v = (a + b[...].astype(layer.dtype) for a, b in zip((q, k, v), (layer.bq, layer.bk, layer.bv)))
    return q, k, v


class Attention(SequenceMixer):
    """Softmax attention: MHA (num_kv_heads = num_heads or None), GQA, MQA (num_kv_heads = 1); head_dim None = d_model /
    num_heads; window: sliding-window length in tokens (None = full causal); sinks: the first tokens of each document
    stay visible to every later query (StreamingLLM); dilation: the window takes every dilation-th token, spanning
    window * dilation (Longformer); head_masks: a list of one {window, sinks, dilation, growth} per head instead (SemSA
    / MoA: span window * dilation + growth * tokens so far); ring_spare: with windows on every head (and no growth) the
    KV cache is a ring of sinks + window * dilation + ring_spare slots, whatever the context; speculative decoding
    verifies at most ring_spare tokens a round; long_context: past the trained context (max_seq_len, the model's),
    window = each query sees the last max_seq_len tokens (the distances it was trained on), full = every earlier token
    (distances it never saw); rope_scaling: a rotary scaling for a longer context (type linear, llama3, yarn or dynamic,
    with its keys: layers/rotary.py); qkv_bias: biases on the q, k, v projections (Qwen2); out_bias: a bias on the
    output projection (RecurrentGemma); qk_norm: RMSNorm of each head's query and key before the rotary, with eps
    norm_eps (Qwen3); output_gate: None, "head" or "channel", each head's output times sigmoid(x W_g) before the output
    projection, one gate per head or per channel (Gated Attention, Qwen3-Next); rope_fraction: the rotary turns the
    first int(head_dim * rope_fraction) dims of each head, the rest stay unrotated (transformers'
    partial_rotary_factor), 0 none at all (no positional encoding: Jamba, Nemotron-H); differential: Differential
    Transformer attention, each head the difference of two softmax maps (its query and key split in halves) with a
    learnt λ, then RMSNorm (head_dim even; layer_id, the model's, sets λ_init); context_split ("contiguous" |
    "zigzag"): with a sequence split over the mesh's context axis, which queries each device runs, its own span or
    the zigzag's early and late chunk (about the same causal work on every device: kernels/context.py); impl ("auto" |
    "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype: the compute dtype
    (parameters stay float32)."""
    grows_with_context = True  # the KV cache holds max_len slots (every other mixer's state is fixed)
    context_parallel = True  # kernels.attention's form split over the context axis; the rest is per token
    kv_cache = None  # the cache's storage, read by init_state: None (compute dtype) or "int8"

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, window: PosInt | None = None, sinks: NonNegInt = 0,
                 dilation: PosInt = 1, head_masks: tuple[HeadMask, ...] | None = None, ring_spare: PosInt = 16,
                 rope_base: PosFloat = 10000.0, rope_scaling: RopeScaling | None = None, qkv_bias: bool = False,
                 out_bias: bool = False, qk_norm: bool = False, norm_eps: PosFloat = 1e-6,
                 output_gate: Annotated[str | None, OneOf(None, "head", "channel")] = None,
                 rope_fraction: Annotated[float, Range(0, 1)] = 1.0, differential: bool = False,
                 long_context: Annotated[str, OneOf("window", "full")] = "window", max_seq_len: int | None = None,
                 layer_id: int = 0, context_split: ContextSplit = "contiguous", impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        check_impl(impl, "Attention")
        context.check_split(context_split, "Attention")
        if long_context not in ("window", "full"):
            raise ValueError(f"long_context={long_context!r}; expected 'window' or 'full'")
        if window is not None and window < 1 or max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"window={window} and max_seq_len={max_seq_len} must be positive or None")
        H, G, K = head_shape(d_model, num_heads, num_kv_heads, head_dim)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        qk = self._check_options(K, output_gate, rope_fraction, differential, layer_id)  # a query's dims
        masks = _head_masks(H, window, sinks, dilation, head_masks, ring_spare)
        ring = all(m.window is not None and m.growth == 0 for m in masks)  # explicit windows alone
        if long_context == "window" and max_seq_len is not None:  # each head spans at most max_seq_len tokens
            fit = lambda m: min(m.window or max_seq_len, -(-max_seq_len // m.dilation))
            masks = [m if m.growth else dataclasses.replace(m, window=fit(m)) for m in masks]
        self._band(masks)
        # A ring buffer: slots for the sinks, then the last window * dilation + ring_spare tokens.
        self.ring = (max(m.sinks for m in masks), max(m.window * m.dilation for m in masks) + ring_spare) \
            if ring else None
        self.grows_with_context = not ring
        self.ring_spare, self.rope_base, self.impl, self.dtype = ring_spare, rope_base, impl, dtype
        self.context_split = context_split
        self.rope_scaling = rope_scaling
        self.exact_up_to = rope_scaling.original_max_position_embeddings \
            if rope_scaling is not None and rope_scaling.type == "dynamic" else None
        make_projections(self, d_model, H, G, K, qkv_bias, rngs)
        self.bo = nnx.Param(jnp.zeros((d_model,), jnp.float32), **axes("embed")) if out_bias else None
        self.q_norm, self.k_norm = (RMSNorm(qk, eps=norm_eps), RMSNorm(qk, eps=norm_eps)) if qk_norm else (None, None)
        gate = {None: None, "head": (H,), "channel": (H, K)}[output_gate]
        init = nnx.initializers.normal(d_model ** -0.5)
        gate_axes = ("heads",) + (None,) * (len(gate or ()) - 1)
        self.w_out_gate = None if gate is None else nnx.Param(init(rngs.params(), (d_model, *gate)),
                                                              **axes("embed", *gate_axes))
        self.b_out_gate = None if gate is None or not qkv_bias else nnx.Param(jnp.zeros(gate, jnp.float32),
                                                                              **axes(*gate_axes))
        self.differential = differential
        if differential:  # the layer's λ vectors, and the norm of each head's output
            lam = lambda: nnx.Param(0.1 * jax.random.normal(rngs.params(), (qk,), jnp.float32))
            self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = lam(), lam(), lam(), lam()
            self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_id)
            self.sub_norm = RMSNorm(K, eps=1e-5)

    def _check_options(self, K: int, output_gate, rope_fraction: float, differential: bool, layer_id: int) -> int:
        """The options' checks; sets self.rotary_dim and returns a query's (half's, when differential) dims."""
        if output_gate not in (None, "head", "channel"):
            raise ValueError(f"output_gate={output_gate!r}; expected None, 'head' or 'channel'")
        if differential and K % 2:
            raise ValueError(f"differential=True splits each head's query and key in halves: head_dim={K} must be even")
        if layer_id < 0:
            raise ValueError(f"layer_id={layer_id}; expected >= 0 (the layer's 0-based depth)")
        qk = K // 2 if differential else K
        self.rotary_dim = int(qk * rope_fraction) if 0 <= rope_fraction <= 1 else -1
        if rope_fraction != 0 and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rope_fraction={rope_fraction} rotates int({qk} * {rope_fraction}) = {self.rotary_dim} "
                             f"dims of each {'half ' if differential else ''}query; expected 0 (no rotary) or 0 < "
                             "rope_fraction <= 1 giving an even number >= 2")
        return qk

    def _band(self, masks):
        """self.band, the masks in force as the kernels take them (kernels.attention.Band): each field
        one number when all heads share it, else a tuple per head (a head without a window: 2**30)."""
        fields = {}
        for name in ("window", "sinks", "dilation", "growth"):
            values = [getattr(m, name) for m in masks]
            fields[name] = values[0] if len(set(values)) == 1 else tuple(2 ** 30 if x is None else x for x in values)
        self.band = Band(**fields)

    def _qkv(self, x, positions):
        q, k, v = project_qkv(self, x)
        B, T, _, K = q.shape
        if self.differential:  # each head's query and key as two of K/2 dims, [q1 | q2]
            q, k = (a.reshape(B, T, -1, K // 2) for a in (q, k))  # (B, T, 2H|2G, K/2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary = lambda a: apply_rotary(a, positions, self.rope_base, self.rope_scaling, self.rotary_dim) \
            if self.rotary_dim else a
        q, k = (rotary(a).reshape(B, T, -1, K) for a in (q, k))  # (B, T, H|G, K)
        # On a mesh: heads split over `tensor`, rows over the batch axes (no-op on one device).
        q = constrain(q, ("batch", "length", "heads", None))
        k, v = (constrain(a, ("batch", "length", "kv_heads", None)) for a in (k, v))
        return q, k, v

    def _half(self, a, h: int | None):
        """a's dims of query/key half h (0 or 1), or all of them (h None)."""
        d = a.shape[-1] // 2
        return a if h is None else a[..., h * d:(h + 1) * d]

    def _heads(self, attend, x):
        """Each head's output (B, T, H, K) from attend(h), the op on query/key half h (None: whole heads): the
        differential combination and the output gate where the layer has them."""
        if self.differential:
            lam = lambda q, k: jnp.exp(jnp.sum(q[...] * k[...]))
            lam = lam(self.lambda_q1, self.lambda_k1) - lam(self.lambda_q2, self.lambda_k2) + self.lambda_init
            o = attend(0).astype(jnp.float32) - lam * attend(1).astype(jnp.float32)
            o = (self.sub_norm(o) * (1 - self.lambda_init)).astype(self.dtype)
        else:
            o = attend(None)
        if self.w_out_gate is not None:
            g = project(x.astype(self.dtype), self.w_out_gate[...].astype(self.dtype))  # (B, T, H) or (B, T, H, K)
            g = g if self.b_out_gate is None else g + self.b_out_gate[...].astype(self.dtype)
            o = o * jax.nn.sigmoid(g.reshape(*g.shape[:3], -1))  # (B, T, H, 1|K)
        return o

    def _out(self, o):
        B, T, H, K = o.shape
        y = project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)
        return y if self.bo is None else y + self.bo[...].astype(self.dtype)

    def _check_length(self, n: int, what: str):
        if self.exact_up_to is not None and n > self.exact_up_to:
            raise ValueError(f"Attention: {what} of {n} tokens exceeds {self.exact_up_to}, the context where dynamic "
                             "rope scaling is the plain rotary (past it transformers re-derives the frequencies from "
                             "the running length, which this layer cannot match); keep within it")

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        self._check_length(T, "a sequence")
        positions = positions_in_document(segment_ids, B, T)
        q, k, v = self._qkv(x, positions)
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        part = self._half
        return self._out(self._heads(lambda h: attention(part(q, h), part(k, h), v, segment_ids=doc, band=self.band,
                                                         impl=self.impl, context_split=self.context_split), x))

    def init_state(self, batch_size: int, max_len: int) -> KVCache:
        """A KV cache of max_len slots, or of a ring buffer's whatever max_len (module docstring)."""
        self._check_length(max_len, "a KV cache")
        max_len = max_len if self.ring is None else sum(self.ring)
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        if self.kv_cache not in (None, "int8"):
            raise ValueError(f"Attention.kv_cache={self.kv_cache!r}; expected None or 'int8'")
        int8 = self.kv_cache == "int8"
        scale = (lambda: jnp.zeros((*shape[:3], 1), jnp.float32)) if int8 else (lambda: None)
        return KVCache(k=jnp.zeros(shape, jnp.int8 if int8 else self.dtype),
                       v=jnp.zeros(shape, jnp.int8 if int8 else self.dtype),
                       **empty_cache(batch_size, max_len), k_scale=scale(), v_scale=scale(),
                       token_index=None if self.ring is None else jnp.full((batch_size, max_len), -1, jnp.int32))

    def decode(self, x: Float[Array, "B T D"], cache: KVCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback` (layers/state.py): index, pos
        and cur_doc per step, (T, B); the slots as written, since a rolled-back row masks the slots
        past its index as unwritten and its next decode overwrites them (a ring buffer: T <= ring_spare)."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        if steps and self.ring is not None and T > self.ring_spare:
            raise ValueError(f"Attention.decode: steps=True over {T} tokens needs ring_spare >= {T} (it is "
                             f"{self.ring_spare}): a rollback would miss the window's tokens those slots held")
        if self.ring is None:
            self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = document_index(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v = self._qkv(x, positions)
        ck, cv = _load(cache.k, cache.k_scale, self.dtype), _load(cache.v, cache.v_scale, self.dtype)  # (B, G, S, K)
        part = self._half
        o = self._heads(lambda h: attention_cached(
            part(q, h), part(k, h), v, CacheView(part(ck, h), cv, cache.index, cache.doc, cache.token_index),
            segment_ids=doc, doc_positions=positions, band=self.band, impl=self.impl), x)
        # Written after the read: XLA then updates the cache in place.
        if self.ring is None:
            write = lambda c, a: None if c is None else write_rows(c, a.transpose(0, 2, 1, 3), cache.index, 2)
            write_doc, token_index = write_rows(cache.doc, doc, cache.index, 1), None
        else:
            at = self._ring_slots(cache.index, positions, doc)  # (B, T)
            rows = jnp.arange(B)[:, None]
            write = lambda c, a: None if c is None else c.at[rows, :, at].set(a.astype(c.dtype), mode="drop")
            write_doc = cache.doc.at[rows, at].set(doc, mode="drop")
            token_index = cache.token_index.at[rows, at].set(cache.index[:, None] + jnp.arange(T), mode="drop")
        (k, k_scale), (v, v_scale) = (_store(a, cache.k_scale is not None) for a in (k, v))
        slots = dict(k=write(cache.k, k), v=write(cache.v, v), doc=write_doc, token_index=token_index,
                     k_scale=write(cache.k_scale, k_scale), v_scale=write(cache.v_scale, v_scale))
        counters = cache_counters(cache.index, doc, positions, steps)
        return self._out(o), (KVCache.stepped if steps else KVCache)(**slots, **counters)

    def _ring_slots(self, index, positions, doc):
        """(B, T) the ring buffer's slot of each new token: the last document's tokens at positions
        below the sinks in their slot, the call's last `ring` tokens past the sinks at sinks + their
        index mod ring; the others (overwritten within the call, or an earlier document's sinks) to
        slot S, out of bounds: not written."""
        n, L = self.ring
        T = positions.shape[1]
        t = jnp.arange(T, dtype=jnp.int32)[None]  # (1, T)
        sink = (positions < n) & (doc == doc[:, -1:])
        in_ring = (positions >= n) & (t >= T - L)
        return jnp.where(sink, positions, jnp.where(in_ring, n + (index[:, None] + t) % L, n + L))
