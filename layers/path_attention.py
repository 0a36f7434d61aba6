"""PaTH attention (Yang, Wang, Zhang, Shen, Kim, Panda, 2025, "PaTH Attention: Position Encoding via
Accumulating Householder Transformations", arXiv:2505.16381), with flash-linear-attention's layer options.

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V               per head; G kv heads shared by H / G query heads
    w_t = L2norm(SiLU(conv(x W_w^down W_w^up))_t)           per kv head: a short causal conv, unit length
    β_t = 2 σ(x_t W_β + b_β)                                per kv head, in (0, 2)
    H_t = I - β_t w_t w_t^T
    o_i = Σ_{j <= i} softmax_j(scale (q_i^T H_i ... H_{j+1} k_j + c_i - c_j)) v_j,   scale = K^-1/2
    y_t = concat_h(o_t) W_O

with c_t = Σ_{l <= t} log σ(x_l w_f + b_f) per query head under `use_forget_gate` (FoX's gate, PaTH-FoX), else 0.
No rotary: the product of Householder factors is the position signal.

Code names: `w_down`, `w_up` the low-rank W_w (rank `w_rank`; 0 = one full (D, G K) matrix `w_full`), `w_conv`
the short convolution (`conv_size` taps, 0 = none), `w_beta`, `b_beta` for β, `w_f`, `b_f` the forget gate,
`c` its cumulative log (B, T, H) float32. The op is kernels/path (reference.py: the query walking back over
the keys; dense.py: blocks of `chunk_size` against the keys carried to each block's start).

Departures, named:
- the forget gate's c_i - c_j is multiplied by `scale` with the logit, as fla's PaTH kernels and decoding do
  (FoX's own layer, layers/fox.py, adds it unscaled);
- b_β and b_f start at zero (β = 1, f = 1/2 at the start), the projections normal(D^-1/2) (fla: nn.Linear's
  uniform default); the decode cache keeps the transformed keys in the compute dtype, as fla does, so in
  bfloat16 the repeated k_j <- H_t k_j rounds a little each token;
- training and decode run one dense form (kernels/path/dense.py) on every backend; fla's Triton kernels are
  flash-style and keep the products as low-rank block factors; there is no Pallas kernel.

Decoding (the paper's): the KV cache of layers/attention.py with each key carried through the factors of the
later tokens of its document: a token applies H_t to every cached key of its row's current document
(k_j <- H_t k_j, O(S K)), writes its own key, then attends as plain softmax attention; a T-token call does this
block-wise (the same function). Also kept: the w stream's conv window and, with the gate, c of every slot and
c_last. Every token rewrites the cached keys, so `k` is not a `final` field: decode(steps=True) keeps the keys
after every token, (T, B, G, S, K), for `rollback`; v, doc and c are kept as written (slots past a row's index
are never read).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.path import PathSlots, path_attention, path_attention_cached
from kernels.segments import document_index, positions_in_document
from layers.attention import KVCache
from layers.conv import ShortConvolution
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, NonNegInt, PosFloat, PosInt
from layers.shapes import head_shape
from layers.sharding import axes, constrain
from layers.state import cache_counters, empty_cache, per_token, state


@state(final=("v", "doc", "k_scale", "v_scale", "c"))
class PaTHCache(KVCache):
    # k holds the transformed keys; None below only as the dataclass's default (fields after KVCache's defaults).
    conv: Float[Array, "B W G*K"] | None = None  # (B, conv_size - 1, G*K) the w stream's last inputs; None: no conv
    c: Float[Array, "B H S"] | None = None  # (B, H, S) float32: c of each slot's token (forget gate only)
    c_last: Float[Array, "B H"] | None = None  # (B, H) float32: c after the row's last token


class PaTHAttention(SequenceMixer):
    """PaTH attention (Yang et al. 2025): softmax attention whose logit q_i^T H_i ... H_{j+1} k_j carries the key
    through a product of data-dependent Householder factors H_t = I - β_t w_t w_t^T (no rotary); num_kv_heads
    (None = num_heads) below num_heads is GQA/MQA; head_dim None = d_model / num_heads; w_rank: rank of the w
    projection (0 = full); conv_size: the w stream's short SiLU convolution (0 = none), conv_bias its bias;
    use_forget_gate: add FoX's cumulative log forget gate (PaTH-FoX); qk_norm: RMSNorm of each head's query and
    key, eps norm_eps; chunk_size: the block of the dense form; impl ("auto" | "reference" | "xla"; no Pallas
    kernel) picks the op's implementation on every path; dtype: the compute dtype (parameters stay float32)."""
    grows_with_context = True  # the KV cache holds max_len slots

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, w_rank: NonNegInt = 32, conv_size: NonNegInt = 3,
                 conv_bias: bool = False, use_forget_gate: bool = False, qk_norm: bool = False,
                 norm_eps: PosFloat = 1e-6, chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        check_no_pallas(impl, "PaTHAttention")
        H, G, K = head_shape(d_model, num_heads, num_kv_heads, head_dim)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        self.chunk_size, self.impl, self.dtype = chunk_size, impl, dtype
        init = nnx.initializers.normal(d_model ** -0.5)
        self.wq = nnx.Param(init(rngs.params(), (d_model, H, K)), **axes("embed", "heads", None))
        self.wk = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wv = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.wo = nnx.Param(nnx.initializers.normal((H * K) ** -0.5)(rngs.params(), (H, K, d_model)),
                            **axes("heads", None, "embed"))
        if w_rank:  # fla's default for MHA: few parameters for w
            self.w_down = nnx.Param(init(rngs.params(), (d_model, w_rank)), **axes("embed", None))
            self.w_up = nnx.Param(nnx.initializers.normal(w_rank ** -0.5)(rngs.params(), (w_rank, G, K)),
                                  **axes(None, "kv_heads", None))
            self.w_full = None
        else:
            self.w_down = self.w_up = None
            self.w_full = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None))
        self.w_conv = ShortConvolution(G * K, conv_size, activation=True, use_bias=conv_bias, channel_axis="kv_heads",
                                       rngs=rngs) if conv_size else None
        self.w_beta = nnx.Param(init(rngs.params(), (d_model, G)), **axes("embed", "kv_heads"))
        self.b_beta = nnx.Param(jnp.zeros((G,), jnp.float32), **axes("kv_heads"))
        if use_forget_gate:
            self.w_f = nnx.Param(init(rngs.params(), (d_model, H)), **axes("embed", "heads"))
            self.b_f = nnx.Param(jnp.zeros((H,), jnp.float32), **axes("heads"))
        else:
            self.w_f = self.b_f = None
        self.q_norm, self.k_norm = (RMSNorm(K, eps=norm_eps), RMSNorm(K, eps=norm_eps)) if qk_norm else (None, None)

    def _project(self, x, segment_ids, window, c_start, steps: bool):
        """q (B, T, H, K), k, v, w (B, T, G, K), β (B, T, G) float32, c (B, T, H) float32 continuing c_start (or
        None) and the conv window after the call (per token with steps)."""
        B, T, _ = x.shape
        G, K = self.num_kv_heads, self.head_dim
        x = x.astype(self.dtype)
        q, k, v = (project(x, p[...].astype(self.dtype)) for p in (self.wq, self.wk, self.wv))  # (B, T, H|G, K)
        if self.w_full is not None:
            w = project(x, self.w_full[...].astype(self.dtype))  # (B, T, G, K)
        else:
            w = project(project(x, self.w_down[...].astype(self.dtype)), self.w_up[...].astype(self.dtype))
        if self.w_conv is not None:
            w, window = self.w_conv.decode(w.reshape(B, T, G * K), window, segment_ids=segment_ids, steps=steps)
            w = w.reshape(B, T, G, K)  # (B, T, G, K)
        w = w.astype(jnp.float32)
        w = w * jax.lax.rsqrt(jnp.sum(w * w, axis=-1, keepdims=True) + 1e-6)  # fla's l2norm eps
        beta = 2 * jax.nn.sigmoid(project(x, self.w_beta[...].astype(self.dtype)).astype(jnp.float32)
                                  + self.b_beta[...])  # (B, T, G): β in (0, 2), negative eigenvalues allowed
        c = None
        if self.w_f is not None:
            logit = project(x, self.w_f[...].astype(self.dtype)).astype(jnp.float32) + self.b_f[...]  # (B, T, H)
            c = c_start[:, None] + jnp.cumsum(jax.nn.log_sigmoid(logit), axis=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(q, ("batch", "length", "heads", None))
        k, v = (constrain(a, ("batch", "length", "kv_heads", None)) for a in (k, v))
        return q, k, v, w, beta, c, window

    def _out(self, o):
        B, T, H, K = o.shape
        return project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B = x.shape[0]
        window = None if self.w_conv is None else self.w_conv.init_state(B, self.dtype)
        q, k, v, w, beta, c, _ = self._project(x, segment_ids, window, jnp.zeros((B, self.num_heads), jnp.float32),
                                               False)
        o = path_attention(q, k, v, w, beta, decay=c, segment_ids=segment_ids, impl=self.impl,
                           chunk_size=self.chunk_size)
        return self._out(o)

    def init_state(self, batch_size: int, max_len: int) -> PaTHCache:
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        gate = self.w_f is not None
        return PaTHCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                         **empty_cache(batch_size, max_len),
                         conv=None if self.w_conv is None else self.w_conv.init_state(batch_size, self.dtype),
                         c=jnp.zeros((batch_size, self.num_heads, max_len), jnp.float32) if gate else None,
                         c_last=jnp.zeros((batch_size, self.num_heads), jnp.float32) if gate else None)

    def decode(self, x: Float[Array, "B T D"], cache: PaTHCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback`: k, conv, c_last and the counters per
        step, (T, B, ...); v, doc and c as written."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = document_index(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v, w, beta, c, window = self._project(x, segment_ids, cache.conv, cache.c_last, steps)
        slots = PathSlots(cache.k, cache.v, cache.doc, cache.c)
        run = lambda q, k, v, w, beta, doc, c, slots, index: path_attention_cached(
            q, k, v, w, beta, slots, index, doc=doc, decay=c, impl=self.impl, chunk_size=self.chunk_size)
        if not steps:
            o, slots = run(q, k, v, w, beta, doc, c, slots, cache.index)
            keys = slots.k
        else:  # token by token, keeping the keys after each (the factors rewrite them)
            def one(carry, xs):
                slots, index = carry
                o, slots = run(*(None if a is None else a[:, None] for a in xs), slots, index)
                return (slots, index + 1), (o[:, 0], slots.k)

            xs = tuple(None if a is None else jnp.swapaxes(a, 0, 1) for a in (q, k, v, w, beta, doc, c))  # (T, B, ...)
            (slots, _), (o, keys) = jax.lax.scan(one, (slots, cache.index), xs)
            o = jnp.swapaxes(o, 0, 1)  # (B, T, H, K)
        counters = cache_counters(cache.index, doc, positions, steps)
        new = PaTHCache.stepped if steps else PaTHCache
        return self._out(o), new(k=keys, v=slots.v, doc=slots.doc, k_scale=None, v_scale=None, conv=window,
                                 c=slots.decay, c_last=None if c is None else per_token(c, steps), **counters)
