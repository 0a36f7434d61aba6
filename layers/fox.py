"""Forgetting attention (Lin et al., 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate").

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V       per head; G kv heads shared by H / G query heads (GQA)
    f_t = sigmoid(x_t . w_f + b_f)                   a scalar forget gate per head and token
    c_t = sum_{l <= t} log f_l                       its cumulative log
    o_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(K) + c_i - c_j) v_j
        = sum_j F_ij exp(q_i . k_j / sqrt(K)) v_j / sum_j F_ij exp(q_i . k_j / sqrt(K)),  F_ij = prod_{j < l <= i} f_l
    y_t = concat_h(o_t) W_O

Code names: `logit` is x_t . w_f + b_f, `c` is c_t (B, T, H) float32, the `decay` of kernels/attention (which
adds c_i - c_j to the logits). No positional encoding by default, as FoX: the forget gate is its
position signal (`rope_base` turns a rotary on). The options of the paper's "Pro" block: `qk_norm`
(an RMSNorm over each head's query and key, its scale shared by the heads as in the paper's runs;
the official code now defaults to one per head), `output_norm` (an RMSNorm over each head's output) and
`output_gate` (y_t = (sigmoid(x_t W_G) ⊙ concat_h(o_t)) W_O). Left out: its KV-shift (a data-dependent
token shift of k and v) and the adaptive computation pruning of the later paper. b_f starts at zero.

Packed documents: c is summed over the whole row, across document starts. A query sees only keys of
its own document, and c_i - c_j of two tokens of one document does not depend on where c stood when
the document began: that offset cancels, so a packed document gets the outputs it gets alone.

Decoding: the KV cache (layers/attention.py) plus `c` of every slot's token, (B, H, S) float32, and
`c_last` (B, H), the row's c after its last token, which the next call's cumsum continues from:
decode computes the full pass's logits (up to the float32 rounding of a running sum). c only falls
(about -0.7 a token at f = 1/2), so past ~10^5 tokens of one row its float32 spacing (~10^-3 at |c| ~
10^4) starts to blur c_i - c_j. Rolling back (layers/state.py) keeps the slots as written (`final`;
a row never reads past its index) and takes c_last per step.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_impl, context
from kernels.attention import CacheView, attention, attention_cached, write_rows
from kernels.segments import document_index, positions_in_document
from layers.attention import KVCache
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import ContextSplit, Impl, PosFloat, PosInt
from layers.rotary import apply_rotary
from layers.shapes import head_shape
from layers.sharding import axes, constrain
from layers.state import cache_counters, empty_cache, per_token, state


@state(final=("k", "v", "doc", "k_scale", "v_scale", "c"))
class FoXCache(KVCache):
    # None only as the dataclass's default (fields after KVCache's defaults); init_state fills both.
    c: Float[Array, "B H S"] | None = None  # (B, H, S) float32: c_t of the token in each slot
    c_last: Float[Array, "B H"] | None = None  # (B, H) float32: c after the row's last token


class ForgettingAttention(SequenceMixer):
    """Forgetting attention (FoX, Lin et al. 2025): softmax attention whose logits get c_i - c_j, c the cumulative log
    of a per-head forget gate sigmoid(x . w_f + b_f); num_kv_heads (None = num_heads) below num_heads is GQA/MQA;
    head_dim None = d_model / num_heads; rope_base: None = no positional encoding (FoX's default); qk_norm, output_norm,
    output_gate: the Pro block's per-head RMSNorms (eps norm_eps) of q and k and of the output, and sigmoid output gate;
    context_split ("contiguous" | "zigzag"): with a sequence split over the mesh's context axis, which queries each
    device runs, as Attention's; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every
    path (the attention op's: the Pallas flash kernels take the decay); dtype: the compute dtype (parameters stay
    float32)."""
    grows_with_context = True  # the KV cache holds max_len slots
    context_parallel = True  # kernels.attention's form split over the context axis; c's cumsum XLA partitions

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, rope_base: PosFloat | None = None, qk_norm: bool = False,
                 output_norm: bool = False, output_gate: bool = False, norm_eps: PosFloat = 1e-6,
                 context_split: ContextSplit = "contiguous", impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        check_impl(impl, "ForgettingAttention")
        context.check_split(context_split, "ForgettingAttention")
        H, G, K = head_shape(d_model, num_heads, num_kv_heads, head_dim)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        self.rope_base, self.context_split, self.impl, self.dtype = rope_base, context_split, impl, dtype
        init = nnx.initializers.normal(d_model ** -0.5)
        self.wq = nnx.Param(init(rngs.params(), (d_model, H, K)), **axes("embed", "heads", None))
        self.wk = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wv = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wo = nnx.Param(nnx.initializers.normal((H * K) ** -0.5)(rngs.params(), (H, K, d_model)),
                            **axes("heads", None, "embed"))
        self.wf = nnx.Param(init(rngs.params(), (d_model, H)), **axes("embed", "heads"))
        self.bf = nnx.Param(jnp.zeros((H,), jnp.float32), **axes("heads"))
        self.wg = nnx.Param(init(rngs.params(), (d_model, H, K)), **axes("embed", "heads", None)) if output_gate \
            else None
        norm = lambda on: RMSNorm(K, eps=norm_eps) if on else None
        self.q_norm, self.k_norm, self.o_norm = norm(qk_norm), norm(qk_norm), norm(output_norm)

    def _project(self, x, positions, c_start):
        """q (B, T, H, K), k, v (B, T, G, K) and c (B, T, H) float32 continuing c_start (B, H)."""
        x = x.astype(self.dtype)
        q, k, v = (project(x, w[...].astype(self.dtype)) for w in (self.wq, self.wk, self.wv))  # (B, T, H|G, K)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_base is not None:
            q, k = (apply_rotary(a, positions, self.rope_base) for a in (q, k))
        q = constrain(q, ("batch", "length", "heads", None))
        k, v = (constrain(a, ("batch", "length", "kv_heads", None)) for a in (k, v))
        logit = project(x, self.wf[...].astype(self.dtype)).astype(jnp.float32) + self.bf[...]  # (B, T, H)
        c = c_start[:, None] + jnp.cumsum(jax.nn.log_sigmoid(logit), axis=1)  # (B, T, H)
        return q, k, v, c

    def _out(self, o, x):
        B, T, H, K = o.shape
        if self.o_norm is not None:
            o = self.o_norm(o)
        if self.wg is not None:
            o = o * jax.nn.sigmoid(project(x.astype(self.dtype), self.wg[...].astype(self.dtype)))
        return project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        q, k, v, c = self._project(x, positions_in_document(segment_ids, B, T),
                                   jnp.zeros((B, self.num_heads), jnp.float32))
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        return self._out(attention(q, k, v, segment_ids=doc, impl=self.impl, decay=c, context_split=self.context_split),
                         x)

    def init_state(self, batch_size: int, max_len: int) -> FoXCache:
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        return FoXCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                        **empty_cache(batch_size, max_len),
                        c=jnp.zeros((batch_size, self.num_heads, max_len), jnp.float32),
                        c_last=jnp.zeros((batch_size, self.num_heads), jnp.float32))

    def decode(self, x: Float[Array, "B T D"], cache: FoXCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback`: index, pos, cur_doc and c_last
        per step, (T, B, ...); the slots as written."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = document_index(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v, c = self._project(x, positions, cache.c_last)
        o = attention_cached(q, k, v, CacheView(cache.k, cache.v, cache.index, cache.doc, decay=cache.c),
                             segment_ids=doc, decay=c, impl=self.impl)
        # Written after the read: XLA then updates the cache in place.
        write = lambda a, new: write_rows(a, new.transpose(0, 2, 1, 3), cache.index, 2)  # (B, T, G, K) as (B, G, T, K)
        slots = dict(k=write(cache.k, k), v=write(cache.v, v), doc=write_rows(cache.doc, doc, cache.index, 1),
                     c=write_rows(cache.c, c.transpose(0, 2, 1), cache.index, 2), k_scale=None, v_scale=None)
        counters = cache_counters(cache.index, doc, positions, steps)
        return self._out(o, x), (FoXCache.stepped if steps else FoXCache)(**slots, **counters,
                                                                           c_last=per_token(c, steps))
