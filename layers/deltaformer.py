"""DeltaFormer (Zhong, Xu, Ao, Shi, 2025, "Understanding Transformer from the Perspective of Associative Memory",
arXiv:2505.19488): the delta rule run in softmax attention's kernel space. Before it is attended to, each value
is corrected by what the earlier tokens already recall for its write query:

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V        per head, G kv heads shared by H / G query heads (GQA)
    w_t = k_t | q_t | x_t W_W                        the write query, `write_key` = "key" | "query" | "separate"
    β_t = σ(x_t W_β + b_β)                           per kv head
    u_i = v_i - β_i Σ_{j < i} softmax_j(w_i . k_j / √K) u_j        over the earlier keys of i's document
    o_t = Σ_{j <= t} softmax_j(q_t . k_j / √K) u_j                 softmax attention with u as the values
    y_t = concat_h(o_t) W_O

q, k (and a separate w) get the rotary of their position in the document (`rope_base`), after the optional
qk_norm (an RMSNorm of each head's query and key, eps `norm_eps`; a separate w gets its own), as
flash-linear-attention's layer. The op is kernels/deltaformer: u from a unit lower-triangular system
(I + diag(β) A) u = v, A the strictly causal row softmax of w . k (blocks of `chunk_size` rows), then the zoo's
softmax attention (kernels/attention) over (k, u).

Code names: `wq`, `wk`, `wv`, `wo` (layers/attention.make_projections) and `bq`, `bk`, `bv` with qkv_bias;
`w_write` W_W (D, G, K), only with write_key="separate"; `w_beta` W_β (D, G) and `b_beta` b_β (G,); `u` the
corrected values, which the decode cache keeps in its `v` slots.

Departures, named:
- the write query: the paper writes a separate w_i (write_key="separate" here); flash-linear-attention's layer
  says it uses key-key similarity and its first version passed k (write_key="key", the default here), while
  its op as the layer now calls it uses q (write_key="query", which needs num_kv_heads == num_heads);
- β = σ(x W_β + b_β), in (0, 1): fla's layer feeds its b_proj's raw output (bias included) as β, unbounded,
  while its op tests draw β from a sigmoid; with β in (0, 1) each step of the system is a contraction-like
  correction (I + diag(β) A has a unit diagonal, always invertible);
- u, β and w are per kv head (GQA shares u between the query heads of a group, so the cache holds G heads of
  u); fla's u stage needs as many kv heads as query heads (and β per query head);
- W_β and b_β start at normal(D^-1/2) and zero (fla: nn.Linear's uniform default); u is cast to the compute
  dtype before the attention and the cache (fla keeps it in the inputs' dtype too);
- training and decode run the dense forms (kernels/deltaformer/parallel.py; fla: Triton kernels for u in
  chunks of 512 rows and FlashAttention for the output); there is no Pallas kernel for u.

Decoding: the KV cache of layers/attention.py (`KVCache`, its `v` holding u), slot s holding the row's token s.
A decode call computes its tokens' u from the cached slots of their document (u of a token is final once
computed) and the earlier tokens of the call, then attends over the cache and itself (attention_cached), then
writes k, u and the documents at the row's index. Slots at or past the index are never read, so a rollback
keeps the slots as written (`final`) and takes the counters.
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.attention import CacheView, attention_cached, write_rows
from kernels.deltaformer import deltaformer, deltaformer_values
from kernels.segments import document_index, positions_in_document
from layers.attention import KVCache, make_projections, project_qkv
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, OneOf, PosFloat, PosInt
from layers.rotary import apply_rotary
from layers.shapes import head_shape
from layers.sharding import axes, constrain
from layers.state import cache_counters, empty_cache

WRITE_KEYS = ("key", "query", "separate")


class DeltaFormer(SequenceMixer):
    """DeltaFormer (Zhong et al. 2025): softmax attention over values u_i = v_i - β_i Σ_{j<i} softmax_j(w_i.k_j/√K)
    u_j, the delta rule in the softmax kernel; num_kv_heads (None = num_heads) below num_heads is GQA/MQA; head_dim
    None = d_model / num_heads (even: rotary); write_key: the write query w, "key" (w = k), "query" (w = q, as
    flash-linear-attention's op; needs num_kv_heads = num_heads) or "separate" (its own projection, the paper's);
    rope_base: the rotary's base; qkv_bias: biases on the q, k, v projections; qk_norm: RMSNorm of each head's query
    and key (and a separate w), eps norm_eps; chunk_size: the rows per block of the triangular solve; impl ("auto"
    | "reference" | "xla"; no Pallas kernel) picks the op's implementation on every path; dtype: the compute dtype
    (parameters stay float32)."""
    grows_with_context = True  # the KV cache holds max_len slots

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, write_key: Annotated[str, OneOf(*WRITE_KEYS)] = "key",
                 rope_base: PosFloat = 10000.0, qkv_bias: bool = False, qk_norm: bool = False,
                 norm_eps: PosFloat = 1e-6, chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        check_no_pallas(impl, "DeltaFormer")
        H, G, K = head_shape(d_model, num_heads, num_kv_heads, head_dim)
        if write_key not in WRITE_KEYS:
            raise ValueError(f"write_key={write_key!r}; expected one of {WRITE_KEYS}")
        if write_key == "query" and G != H:
            raise ValueError(f"write_key='query' writes with each head's query, one per kv head: num_kv_heads={G} "
                             f"must equal num_heads={H} (or use write_key='key' or 'separate')")
        if K % 2:
            raise ValueError(f"head_dim={K} (d_model / num_heads unless given) must be even for the rotary")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        self.write_key, self.rope_base, self.chunk_size, self.impl, self.dtype = \
            write_key, rope_base, chunk_size, impl, dtype
        make_projections(self, d_model, H, G, K, qkv_bias, rngs)
        init = nnx.initializers.normal(d_model ** -0.5)
        separate = write_key == "separate"
        self.w_write = nnx.Param(init(rngs.params(), (d_model, G, K)), **axes("embed", "kv_heads", None)) \
            if separate else None
        self.w_beta = nnx.Param(init(rngs.params(), (d_model, G)), **axes("embed", "kv_heads"))
        self.b_beta = nnx.Param(jnp.zeros((G,), jnp.float32), **axes("kv_heads"))
        norm = lambda on: RMSNorm(K, eps=norm_eps) if on else None
        self.q_norm, self.k_norm, self.w_norm = norm(qk_norm), norm(qk_norm), norm(qk_norm and separate)

    def _project(self, x, positions):
        """q (B, T, H, K), k, v, the write query w (B, T, G, K) and β (B, T, G) float32."""
        q, k, v = project_qkv(self, x)
        w = project(x.astype(self.dtype), self.w_write[...].astype(self.dtype)) if self.w_write is not None else None
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            w = None if w is None else self.w_norm(w)
        rotary = lambda a: None if a is None else apply_rotary(a, positions, self.rope_base)
        q, k, w = rotary(q), rotary(k), rotary(w)
        w = {"key": k, "query": q, "separate": w}[self.write_key]
        beta = project(x.astype(self.dtype), self.w_beta[...].astype(self.dtype)).astype(jnp.float32)  # (B, T, G)
        beta = jax.nn.sigmoid(beta + self.b_beta[...])
        q = constrain(q, ("batch", "length", "heads", None))
        k, v, w = (constrain(a, ("batch", "length", "kv_heads", None)) for a in (k, v, w))
        return q, k, v, w, beta

    def _out(self, o):
        B, T, H, K = o.shape
        return project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        q, k, v, w, beta = self._project(x, positions_in_document(segment_ids, B, T))
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        return self._out(deltaformer(q, k, v, beta, w=w, segment_ids=doc, chunk_size=self.chunk_size,
                                     impl=self.impl))

    def init_state(self, batch_size: int, max_len: int) -> KVCache:
        """A KV cache of max_len slots whose `v` holds each token's u."""
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                       **empty_cache(batch_size, max_len))

    def decode(self, x: Float[Array, "B T D"], cache: KVCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback`: index, pos and cur_doc per step,
        (T, B); the slots as written (a row never reads a slot at or past its index)."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = document_index(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v, w, beta = self._project(x, positions)
        view = CacheView(cache.k, cache.v, cache.index, cache.doc)
        u = deltaformer_values(w, k, v, beta, segment_ids=doc, cache=view, chunk_size=self.chunk_size,
                               impl=self.impl).astype(self.dtype)  # (B, T, G, K)
        o = attention_cached(q, k, u, view, segment_ids=doc, impl=self.impl)
        # Written after the read: XLA then updates the cache in place.
        write = lambda c, a: write_rows(c, a.transpose(0, 2, 1, 3), cache.index, 2)  # (B, T, G, K) as (B, G, T, K)
        slots = dict(k=write(cache.k, k), v=write(cache.v, u), doc=write_rows(cache.doc, doc, cache.index, 1))
        counters = cache_counters(cache.index, doc, positions, steps)
        return self._out(o), (KVCache.stepped if steps else KVCache)(**slots, **counters)
