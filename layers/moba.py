"""MoBA mixer: softmax attention over a few key blocks per query (Lu et al. 2025, kernels/moba).

Projections, rotary and GQA are layers/attention.py's (this class extends `Attention`); the training
path is kernels.moba.moba. Each query head attends to its own block (causally) and the top_k - 1
earlier blocks of its document whose mean-pooled (post-rotary) keys score highest against it; blocks
count from each document's start, so packed documents equal documents alone.

Decode keeps attention's KV cache and beside it `MoBABlocks`, the key sum of every complete block of
the current document: a new token scores the S / b block sums, then reads from the cache only the
keys and values of the blocks it selects and of its own block ((top_k - 1) b + b slots), reading
the cache before writing it (as kernels.attention.attention_cached does, so XLA updates it in place).
When a token completes a block, its sum (the block's cached keys plus the token's) enters the table.
A call of T tokens runs token by token (lax.scan): exact to the full pass, and a step's cost does not
read the whole cache. Departures: no sliding window, rope scaling, qkv bias, qk norm or int8 cache
(options of `Attention` that MoBA does not take); a query sees its whole document (no long_context).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels.attention import write_rows
from kernels.moba import attend_blocks, check_blocks, moba, pooled_gate, select_blocks, take
from kernels.segments import document_index, positions_in_document
from layers.attention import Attention, KVCache
from layers.options import Impl, PosFloat, PosInt
from layers.state import state


@state
class MoBABlocks:
    sums: Float[Array, "B G N K"]  # (B, G, N, K) float32: key sum of block n of the current document, n < pos // b


class BlockSparse(Attention):
    """The decode driver that MoBA and NSA (layers/nsa.py) share: attention's projections, its KV cache
    beside a table of per-block state (`init_table`), and a call of T tokens run token by token
    through `_step(carry, (q, k, v, *extra, p, d)) -> (carry, o)`, reading the cache before writing it."""

    context_parallel = False  # the block selections (kernels/moba, kernels/nsa) have no form (kernels/context.py)

    def _extra(self, x):
        """Per-token inputs of a step beyond q, k, v, each (B, T, ...)."""
        return ()

    def init_table(self, batch_size: int, max_len: int):
        raise NotImplementedError

    def init_state(self, batch_size: int, max_len: int) -> tuple:
        if self.kv_cache is not None:
            raise ValueError(f"{type(self).__name__}.kv_cache={self.kv_cache!r}: the cache stays in the compute dtype "
                             "(None)")
        return super().init_state(batch_size, max_len), self.init_table(batch_size, max_len)

    def decode(self, x: Float[Array, "B T D"], state: tuple, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """Token by token through the cache (lax.scan). steps=True returns the state after every token
        (layers/state.py): the KV cache's slots once (final), the table per step."""
        self._check(x, segment_ids, steps)
        cache, table = state
        B, T, _ = x.shape
        self._check_room(cache.index, T, cache.k.shape[2])
        positions = positions_in_document(segment_ids, B, T, start=cache.pos)  # (B, T)
        doc = cache.cur_doc[:, None] + document_index(segment_ids, B, T)  # (B, T)
        inputs = (*self._qkv(x, positions), *self._extra(x))

        def step(carry, xs):
            carry, o = self._step(carry, (*(a[:, None] for a in xs[:-2]), *xs[-2:]))
            cache, table = carry
            return carry, (o[:, 0], (cache.cur_doc, cache.pos, cache.index, table) if steps else None)

        time_major = tuple(jnp.swapaxes(a, 0, 1) for a in (*inputs, positions, doc))  # (T, B, ...)
        (cache, table), (o, stepped) = jax.lax.scan(step, (cache, table), time_major)
        y = self._out(jnp.swapaxes(o, 0, 1))  # (B, T, D)
        if steps:
            cur_doc, pos, index, tables = stepped  # (T, B, ...)
            return y, (KVCache.stepped(k=cache.k, v=cache.v, doc=cache.doc, cur_doc=cur_doc, pos=pos, index=index,
                                       k_scale=None, v_scale=None), tables)
        return y, (cache, table)

    @staticmethod
    def _written(cache: KVCache, k, v, d, p) -> KVCache:
        """The cache after one token: k, v (B, 1, G, K|V) written at each row's index."""
        write = lambda c, a: write_rows(c, a.transpose(0, 2, 1, 3), cache.index, 2)
        return KVCache(k=write(cache.k, k), v=write(cache.v, v), doc=write_rows(cache.doc, d[:, None], cache.index, 1),
                       cur_doc=d, pos=p + 1, index=cache.index + 1)


class MoBA(BlockSparse):
    """MoBA, Mixture of Block Attention (Lu et al. 2025): each query head attends to its own block of block_size tokens
    (causally) and the top_k - 1 earlier blocks of its document whose mean-pooled keys score highest against it (top_k
    counts the own block, as the paper does); GQA with num_kv_heads; decode scores the cached block sums and reads only
    the selected blocks of the KV cache; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path; dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_kv_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, block_size: PosInt = 16, top_k: PosInt = 3,
                 rope_base: PosFloat = 10000.0, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        check_blocks(block_size, top_k, "MoBA")
        super().__init__(d_model, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         rope_base=rope_base, long_context="full", impl=impl, dtype=dtype, rngs=rngs)
        self.block_size, self.top_k = block_size, top_k

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        self._check(x, segment_ids)
        B, T, _ = x.shape
        q, k, v = self._qkv(x, positions_in_document(segment_ids, B, T))
        doc = None if segment_ids is None else document_index(segment_ids, B, T)
        return self._out(moba(q, k, v, block_size=self.block_size, top_k=self.top_k, segment_ids=doc, impl=self.impl))

    def init_table(self, batch_size: int, max_len: int) -> MoBABlocks:
        N = -(-max_len // self.block_size)
        return MoBABlocks(sums=jnp.zeros((batch_size, self.num_kv_heads, N, self.head_dim), jnp.float32))

    def _step(self, carry, inputs):
        """One token against the cache: q (B, 1, H, K), k/v (B, 1, G, K|V); p, d (B,): its document
        position and number."""
        cache, blocks = carry
        q, k, v, p, d = inputs
        b, i = self.block_size, cache.index
        start, cur = i - p, p // b  # (B,): the document's first slot, the token's block
        gate = pooled_gate(q, blocks.sums[:, :, None], cur[:, None], b)  # (B, 1, H, N)
        o = attend_blocks(q, cache.k, cache.v, i[:, None], start[:, None], select_blocks(gate, self.top_k), b,
                          self.head_dim ** -0.5, own=(k, v))
        own = take(cache.k, jnp.broadcast_to((start + cur * b)[:, None, None] + jnp.arange(b), (*cache.k.shape[:2], b)))
        earlier = (jnp.arange(b) < p[:, None] % b)[:, None, :, None]  # (B, 1, b, 1): the block's slots before i
        total = jnp.sum(jnp.where(earlier, own.astype(jnp.float32), 0.0), axis=2) + k[:, 0].astype(jnp.float32)
        done = (p % b == b - 1)[:, None, None, None]  # (B, 1, 1, 1): the token completes its block
        sums = jnp.where(done, write_rows(blocks.sums, total[:, :, None], cur, 2), blocks.sums)
        return (self._written(cache, k, v, d, p), MoBABlocks(sums=sums)), o
