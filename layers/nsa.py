"""Native Sparse Attention mixer (Yuan et al. 2025, kernels/nsa): compressed, selected and sliding-window
branches over one set of keys and values, mixed by learned sigmoid gates.

Code names -> the paper: block_len l, stride d (compression blocks), select_len l', num_selected n
(selection blocks, the initial and two local ones included), window w; `_compress` is phi (eq. 7),
`wg`/`bg` give g^cmp, g^slc, g^win. Projections, rotary and GQA are layers/attention.py's; the
selection is per kv group (eq. 10).

Decode (layers/moba.py's BlockSparse driver, token by token): attention's KV cache and beside it
`NSACompressed`, the compressed key and value of every complete block of the current document. A
token compresses the block it completes (its l - 1 cached keys and its own), attends to the
compressed table (S / d entries), scores the selection blocks from those probabilities, and reads
from the cache only its n selected blocks (n l' slots) and its window (w slots).

Departures from the paper, named:
- one set of keys and values serves the three branches (the paper gives each branch its own, against
  shortcut learning between them): one KV cache instead of three;
- phi is a two-layer MLP shared by the kv heads: the block's keys plus a learned position embedding
  (l, K), flattened, -> K (GELU) -> K; one such MLP for keys, one for values (the paper specifies only
  "an MLP with intra-block position encoding");
- the gates are one linear layer of the input and a sigmoid per head and branch (the paper: an MLP);
- the compressed branch sees a block once its last token is reached (the token itself included);
- no Triton-style blocked kernel: training runs kernels/nsa's dense masked form.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels.attention import write_rows
from kernels.attention.xla import attention_dense_parts
from kernels.moba import attend_blocks, take
from kernels.nsa import NSASizes, masked_attention, nsa, overlap_in_strides, select_blocks
from kernels.segments import document_index, positions_in_document
from layers.linear import project
from layers.moba import BlockSparse
from layers.options import Impl, PosFloat, PosInt
from layers.sharding import axes
from layers.state import state


@state
class NSACompressed:
    k: Float[Array, "B G N K"]  # (B, G, N, K): compressed key of block i of the current document, i < N
    v: Float[Array, "B G N K"]  # (B, G, N, K): compressed value


class NativeSparseAttention(BlockSparse):
    """NSA, Native Sparse Attention (Yuan et al. 2025): three branches mixed by learned sigmoid gates: compressed
    (blocks of block_len keys every stride tokens, each compressed by a learned MLP), selected (num_selected blocks of
    select_len keys, the initial and the two local ones always, the others by the compressed branch's attention summed
    over a kv group) and a sliding window of window tokens; GQA with num_kv_heads. One set of keys and values serves the
    three branches; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype:
    the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, block_len: PosInt = 16, stride: PosInt = 8, select_len: PosInt = 16,
                 num_selected: PosInt = 4, window: PosInt = 32, rope_base: PosFloat = 10000.0, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        NSASizes(block_len, stride, select_len, num_selected, window)  # refuses sizes NSA cannot run
        super().__init__(d_model, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         rope_base=rope_base, long_context="full", impl=impl, dtype=dtype, rngs=rngs)
        self.block_len, self.stride, self.select_len = block_len, stride, select_len
        self.num_selected, self.sliding = num_selected, window
        K, H, lk = self.head_dim, self.num_heads, block_len * self.head_dim
        init = lambda shape, fan_in: nnx.initializers.normal(fan_in ** -0.5)(rngs.params(), shape)
        self.cmp_pos = nnx.Param(init((2, block_len, K), K) * 0.1, **axes(None, None, None))  # intra-block position
        self.cmp_w1 = nnx.Param(init((2, lk, K), lk), **axes(None, None, None))  # replicated: small
        self.cmp_w2 = nnx.Param(init((2, K, K), K), **axes(None, None, None))
        self.wg = nnx.Param(init((d_model, H, 3), d_model), **axes("embed", "heads", None))
        self.bg = nnx.Param(jnp.zeros((H, 3), jnp.float32), **axes("heads", None))

    def _compress(self, blocks, which: int):
        """phi: blocks (..., l, K) of keys (which=0) or values (1) -> (..., K)."""
        p = lambda w: w[which].astype(self.dtype)
        x = (blocks + p(self.cmp_pos)).reshape(*blocks.shape[:-2], -1)  # (..., l K)
        return jax.nn.gelu(x @ p(self.cmp_w1)) @ p(self.cmp_w2)

    def _extra(self, x):
        g = project(x.astype(self.dtype), self.wg[...].astype(self.dtype))  # (B, T, H, 3)
        return (jax.nn.sigmoid(g.astype(jnp.float32) + self.bg[...]),)

    def _sizes(self) -> NSASizes:
        return NSASizes(self.block_len, self.stride, self.select_len, self.num_selected, self.sliding)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions_in_document(segment_ids, B, T))
        slots = jnp.clip(jnp.arange(T)[:, None] - self.block_len + 1 + jnp.arange(self.block_len), 0, T - 1)  # (T, l)
        blocks = lambda a: jnp.moveaxis(a[:, slots], 3, 2)  # (B, T, G, l, K): the l tokens ending at each slot
        k_cmp, v_cmp = self._compress(blocks(k), 0), self._compress(blocks(v), 1)  # (B, T, G, K)
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        o = nsa(q, k, v, k_cmp, v_cmp, *self._extra(x), self._sizes(), segment_ids=doc, impl=self.impl)
        return self._out(o)

    def init_table(self, batch_size: int, max_len: int) -> NSACompressed:
        N = max(1, (max_len - self.block_len) // self.stride + 1)
        zeros = lambda: jnp.zeros((batch_size, self.num_kv_heads, N, self.head_dim), self.dtype)
        return NSACompressed(k=zeros(), v=zeros())

    def _step(self, carry, inputs):
        """One token against the cache: q (B, 1, H, K), k/v (B, 1, G, K|V), gates (B, 1, H, 3); p, d (B,):
        its document position and number."""
        cache, table = carry
        q, k, v, gates, p, d = inputs
        B, _, H, K = q.shape
        G, N, S = cache.k.shape[1], table.k.shape[2], cache.k.shape[2]
        bl, ls, w, i = self.block_len, self.select_len, self.sliding, cache.index
        start, scale = i - p, K ** -0.5
        # Compressed branch: the block this token completes enters the table first (it is visible to the token).
        # (B, G, n - 1): the n - 1 slots before the token
        before = lambda n: jnp.broadcast_to((i[:, None] - n + 1 + jnp.arange(n - 1))[:, None], (B, G, n - 1))
        with_own = lambda c, a: jnp.concatenate([take(c, before(bl)), jnp.moveaxis(a, 1, 2)], axis=2)  # (B, G, l, K)
        ends = ((p >= bl - 1) & ((p - bl + 1) % self.stride == 0))[:, None, None, None]  # (B, 1, 1, 1)
        block = (p - bl + 1) // self.stride  # (B,): the compressed block ending here; < 0 before the first
        put = lambda t, a: jnp.where(ends, write_rows(t, a[:, :, None], block, 2), t)
        table = NSACompressed(k=put(table.k, self._compress(with_own(cache.k, k), 0)),
                              v=put(table.v, self._compress(with_own(cache.v, v), 1)))
        qg = jnp.moveaxis(q.reshape(B, 1, G, H // G, K), 1, 3)  # (B, G, R, 1, K)
        seen = (jnp.arange(N)[None] <= block[:, None])[:, None, None, None]  # (B, 1, 1, 1, N)
        o_cmp, p_cmp = masked_attention(qg, table.k.transpose(0, 2, 1, 3), table.v.transpose(0, 2, 1, 3), seen, scale)
        # Selected branch: scores from p_cmp, then the chosen blocks' slots of the cache and the token itself.
        weight = overlap_in_strides(np.arange(N) * self.stride, bl, ls, self.stride, -(-S // ls))  # (N, NS)
        score = jnp.einsum("BGRTN,NJ->BTGJ", p_cmp, jnp.asarray(weight, jnp.float32))  # (B, 1, G, NS)
        cur = p // ls
        chosen = select_blocks(score, jnp.broadcast_to(cur[:, None, None], (B, 1, G)), self.num_selected)
        chosen = jnp.repeat(jnp.where(chosen == cur[:, None, None, None], -1, chosen), H // G, axis=2)  # (B, 1, H, n)
        o_slc = attend_blocks(q, cache.k, cache.v, i[:, None], start[:, None], chosen, ls, scale, own=(k, v))
        # Sliding window: the w - 1 slots before the token (of its document) and the token itself.
        in_doc = (jnp.arange(w - 1)[None] >= w - 1 - p[:, None])[:, None, None]  # (B, 1, 1, w-1): (B, H, T, S)
        parts = [(take(cache.k, before(w)), take(cache.v, before(w)), in_doc),
                 (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.ones((1, 1, 1, 1), bool))]
        o_win = attention_dense_parts(q, parts, scale)
        o_cmp = jnp.moveaxis(o_cmp, 3, 1).reshape(B, 1, H, -1)  # (B, 1, H, V)
        o = sum(gates[..., c:c + 1] * a.astype(jnp.float32) for c, a in enumerate((o_cmp, o_slc, o_win)))
        return (self._written(cache, k, v, d, p), table), o.astype(q.dtype)
