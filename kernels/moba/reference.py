"""Reference MoBA, Mixture of Block Attention (Lu et al. 2025, arXiv:2502.13189), masked-dense in float32.

The keys of a document are split into blocks of `block_size` tokens counted from the document's
start (block n holds document positions [n b, (n + 1) b)). Query t, in block c_t of its document,
scores each earlier block of its document by its query against the block's mean-pooled key,

    s_t,n = q_t . mean_{j in block n} k_j          (the gate, per query head; n < c_t: complete blocks)

and attends, with one softmax, to the keys of the top_k - 1 highest-scoring earlier blocks and of
its own block c_t (causally: keys up to t):

    o_t = sum_{j in selected(t), j <= t} softmax_j(q_t . k_j * scale) v_j

Code names: `block_size` = the paper's block size B, `top_k` = its k, which counts the current
block, as in the paper and the official code (MoonshotAI/MoBA, moba_naive.py: the current block's
gate is +inf, so it takes one of the k places): a query attends to at most top_k blocks. Blocks after
the query's own are never selectable; with fewer than top_k - 1 earlier blocks, all of them are
taken. Ties go to the lower block number (lax.top_k's order; torch.topk leaves it unspecified).
The gate is not scaled (the official code's q . mean(k) in float32); its choice is discrete, so no
gradient flows through it, only through the selected attention. Grouped-query attention: each query
head chooses its own blocks among the keys of its kv head.

Packed documents (`segment_ids`): blocks are counted from each document's start and hold only its
keys, so a packed document gives exactly the outputs it gives alone (the official varlen code splits
by cu_seqlens the same way).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from kernels.segments import positions_in_document


def moba_gate(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], block_size: int,
              segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B T H N"]:
    """The gate s_t,n of every query against every block n < ceil(T / block_size) of its document;
    -inf where n is not an earlier complete block (n >= c_t). From the definition: a membership mask
    of each query's document blocks over all keys, then q . mean(k)."""
    B, T, H, K = q.shape
    G = k.shape[2]
    N = -(-T // block_size)
    blk = positions_in_document(segment_ids, B, T) // block_size  # (B, T)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    member = (seg[:, :, None, None] == seg[:, None, None, :]) \
        & (blk[:, None, None, :] == jnp.arange(N)[None, None, :, None])  # (B, T, N, S): key s in query t's block n
    pooled = jnp.einsum("BTNS,BSGK->BTNGK", member.astype(jnp.float32), k.astype(jnp.float32)) / block_size
    qg = q.astype(jnp.float32).reshape(B, T, G, H // G, K)  # (B, T, G, R, K)
    gate = jnp.einsum("BTGRK,BTNGK->BTGRN", qg, pooled).reshape(B, T, H, N)
    earlier = jnp.arange(N)[None, None, :] < blk[:, :, None]  # (B, T, N)
    return jnp.where(earlier[:, :, None], gate, -jnp.inf)


def select_blocks(gate: Float[Array, "*L N"], top_k: int) -> Int[Array, "*L _k"]:
    """The top_k - 1 highest gates' block numbers (capped at N), -1 where fewer blocks are selectable
    (gate -inf); ties to the lower block number. The current block is not among them: always taken."""
    n = min(top_k - 1, gate.shape[-1])
    if n == 0:
        return jnp.zeros((*gate.shape[:-1], 0), jnp.int32)
    value, index = lax.top_k(lax.stop_gradient(gate), n)
    return jnp.where(value > -jnp.inf, index, -1).astype(jnp.int32)


def moba_reference(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G V"],
    *,
    block_size: int,
    top_k: int,
    segment_ids: Int[Array, "B T"] | None = None,
    scale: float | None = None,
    selected: Int[Array, "B T H _k"] | None = None,
) -> Float[Array, "B T H V"]:
    """selected: each query head's earlier blocks (select_blocks' output); None = chosen by the gate."""
    B, T, H, K = q.shape
    G = k.shape[2]
    scale = K ** -0.5 if scale is None else scale
    if selected is None:
        selected = select_blocks(moba_gate(q, k, block_size, segment_ids), top_k)
    blk = positions_in_document(segment_ids, B, T) // block_size  # (B, T)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    t = jnp.arange(T)
    seen = (seg[:, :, None] == seg[:, None, :]) & (t[None, None, :] <= t[None, :, None])  # (B, T, S)
    key_blk = blk[:, None, None, :]  # (B, 1, 1, S)
    chosen = (key_blk == blk[:, :, None, None]) | jnp.any(selected[..., None] == key_blk[..., None, :], axis=-2)
    mask = (chosen & seen[:, :, None]).transpose(0, 2, 1, 3).reshape(B, G, H // G, T, T)  # (B, G, R, T, S)
    qg = q.reshape(B, T, G, H // G, K)  # (B, T, G, R, K)
    s = jnp.einsum("BTGRK,BSGK->BGRTS", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, s, -jnp.inf)  # every query sees itself: no row is empty
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("BGRTS,BSGV->BTGRV", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)
