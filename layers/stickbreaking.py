"""Stick-breaking attention (Tan, Yang, Courville, Panda, Shen, 2025, "Scaling Stick-Breaking Attention: An
Efficient Implementation and In-depth Study", ICLR 2025, arXiv:2410.17980).

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V          per head; G kv heads shared by H / G query heads (GQA)
    z_ij = q_i . k_j / sqrt(K),   β_ij = σ(z_ij)          for the keys j < i of i's document
    A_ij = β_ij Π_{j < l < i} (1 - β_il)                  the nearest key breaks the stick first
    o_i  = Σ_j A_ij v_j  (+ r_i v_i with `remainder`),   r_i = Π_{j < i} (1 - β_ij) = 1 - Σ_j A_ij
    y_t  = concat_h(o_t) W_O

Code names: `q`, `k`, `v` as in the equations; the op (kernels/stickbreaking) computes log A_ij = log σ(z_ij)
- Σ_{j<l<i} softplus(z_il) in float32 and returns o and `r`, the stick left over. No positional encoding: the
order of the breaks is the position signal (the paper drops RoPE). `qkv_bias` and `qk_norm` (an RMSNorm of
each head's query and key, eps `norm_eps`) are the options of flash-linear-attention's layer.

Departures, named:
- `remainder` (default off, as flash-linear-attention's layer, which drops r): o_i += r_i v_i, the leftover
  stick on the query's own value, as the official repository's reference and tests
  (shawntan/stickbreaking-attention) compute it; IBM's dolomite-engine layer instead puts r_i on a
  learnt per-head bias vector and RMS-normalises each head's output, neither of which is here;
- j = i is not seen (the paper's and fla's default, attend_current=False): the first token of a document
  sees no key and outputs 0 (or v_i with `remainder`, where r_i = 1);
- training and decode run the dense (T, S) form; the official Triton kernels are flash-style and blocked;
  there is no Pallas kernel.

Decoding: the KV cache of layers/attention.py (`KVCache`, no rotary, no int8 or ring buffer), slot s holding
the row's token s: a decode call writes its keys at the row's index first, then its queries at index + t
see the slots before them of their own document. Slots past a query's position (unwritten, or stale after
a rollback) are never seen, so a rollback keeps the slots as written (`final`) and takes the counters.
"""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.attention import write_rows
from kernels.segments import document_index, positions_in_document
from kernels.stickbreaking import stickbreaking
from layers.attention import KVCache, make_projections, project_qkv
from layers.linear import project
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, PosFloat, PosInt
from layers.shapes import head_shape
from layers.sharding import constrain
from layers.state import cache_counters, empty_cache


class StickBreakingAttention(SequenceMixer):
    """Stick-breaking attention (Tan et al. 2025): each query gives the keys before it, nearest first, a share
    σ(q.k/√K) of what is left of a stick of length 1, no softmax and no positional encoding; num_kv_heads (None =
    num_heads) below num_heads is GQA/MQA; head_dim None = d_model / num_heads; remainder: add the leftover stick
    times the query's own value (the official code's reference); qkv_bias: biases on the q, k, v projections;
    qk_norm: RMSNorm of each head's query and key, eps norm_eps; impl ("auto" | "reference" | "xla"; no Pallas
    kernel) picks the op's implementation on every path; dtype: the compute dtype (parameters stay float32)."""
    grows_with_context = True  # the KV cache holds max_len slots

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, remainder: bool = False, qkv_bias: bool = False,
                 qk_norm: bool = False, norm_eps: PosFloat = 1e-6, impl: Impl = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        check_no_pallas(impl, "StickBreakingAttention")
        H, G, K = head_shape(d_model, num_heads, num_kv_heads, head_dim)
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, H, G, K
        self.remainder, self.impl, self.dtype = remainder, impl, dtype
        make_projections(self, d_model, H, G, K, qkv_bias, rngs)
        self.q_norm, self.k_norm = (RMSNorm(K, eps=norm_eps), RMSNorm(K, eps=norm_eps)) if qk_norm else (None, None)

    def _qkv(self, x):
        q, k, v = project_qkv(self, x)  # (B, T, H|G, K)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(q, ("batch", "length", "heads", None))
        k, v = (constrain(a, ("batch", "length", "kv_heads", None)) for a in (k, v))
        return q, k, v

    def _out(self, o, r, v):
        """y (B, T, D) from o (B, T, H, K), the leftover stick r (B, T, H) and the tokens' own values v (B, T, G, K)."""
        B, T, H, K = o.shape
        if self.remainder:
            own = jnp.repeat(v, H // v.shape[2], axis=2)  # (B, T, H, K): each query head's kv head
            o = (o.astype(jnp.float32) + r[..., None] * own.astype(jnp.float32)).astype(self.dtype)
        return project(o.reshape(B, T, H * K), self.wo[...].astype(self.dtype).reshape(H * K, -1))  # (B, T, D)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        o, r = stickbreaking(q, k, v, segment_ids=doc, impl=self.impl)
        return self._out(o, r, v)

    def init_state(self, batch_size: int, max_len: int) -> KVCache:
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                       **empty_cache(batch_size, max_len))

    def decode(self, x: Float[Array, "B T D"], cache: KVCache, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """steps=True returns the cache after every token, for `rollback`: index, pos and cur_doc per step,
        (T, B); the slots as written (a row never sees a slot at or past its next query's position)."""
        self._check(x, segment_ids, steps)
        B, T, _ = x.shape
        self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = document_index(segment_ids, B, T, cache.cur_doc)  # (B, T)
        q, k, v = self._qkv(x)
        # Written before the read: the new queries see the new keys before them (the op never sees a slot at
        # or after a query's own position, so what the slots held past the index does not matter).
        write = lambda a, new: write_rows(a, new.transpose(0, 2, 1, 3), cache.index, 2)  # (B, T, G, K) as (B, G, T, K)
        slots = dict(k=write(cache.k, k), v=write(cache.v, v), doc=write_rows(cache.doc, doc, cache.index, 1))
        at = cache.index[:, None] + jnp.arange(T, dtype=jnp.int32)  # (B, T): the queries' slots
        o, r = stickbreaking(q, slots["k"], slots["v"], segment_ids=doc, kv_segment_ids=slots["doc"],
                             q_positions=at, impl=self.impl, kv_heads_first=True)
        counters = cache_counters(cache.index, doc, positions, steps)
        return self._out(o, r, v), (KVCache.stepped if steps else KVCache)(**slots, **counters)
