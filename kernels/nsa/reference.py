"""Reference NSA, Native Sparse Attention (Yuan et al. 2025, arXiv:2502.11089), masked-dense in float32.

Three branches per query t, combined by gates from the input (eq. 5):

    o_t = g_t^cmp Attn(q_t, K_cmp, V_cmp) + g_t^slc Attn(q_t, K_slc, V_slc) + g_t^win Attn(q_t, K_win, V_win)

- compressed: block i of a document holds its positions [i d, i d + l) (`block_len` l, `stride` d);
  its key and value, phi(k_{id : id+l}) (eq. 7; phi is learned, layers/nsa.py), are visible to t once
  the block is complete, i d + l - 1 <= t (the paper's i <= floor((t - l) / d), the token t included).
  Here they come per slot: k_cmp[s] is the compressed key of the block whose last token is slot s,
  and only slots where a block ends (`compressed_ends`) take part;
- selected: the compressed branch's attention probabilities p_cmp (eq. 8) score the selection blocks
  j of `select_len` l' ([j l', (j + 1) l')): each compressed block adds its probability times its
  overlap with block j in strides (eq. 9's double sum; equal to it up to the paper's 1-based index
  offset), summed over the query heads of a kv group (eq. 10: one choice per group). The initial
  block and the two local blocks (the query's own, causally masked, and the one before) are always
  selected; the others of the `num_selected` n by score, ties to the lower block; blocks after the
  query's never. Attention over the selected blocks' keys up to t;
- sliding window: the last `window` w keys, t - w < s <= t.

Blocks count from each document's start (`segment_ids`), and no branch looks across a document, so a
packed document gives exactly what it gives alone. A branch that sees no key (the compressed one
before the first block completes) gives zeros and scores every selection block 0.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from kernels.segments import positions_in_document

NEG = -1e30
FORCED = 3  # the initial block and the two local blocks, always selected (the paper's 1 + 2)


@dataclasses.dataclass(frozen=True)
class NSASizes:
    """NSA's sizes (module docstring): compression blocks of block_len l every stride d tokens,
    num_selected n selection blocks of select_len l', a sliding window of `window` w keys. Refused at
    construction when NSA cannot run them."""

    block_len: int
    stride: int
    select_len: int
    num_selected: int
    window: int

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NSASizes: {name}={value!r}; expected a positive int")
        if self.block_len % self.stride or self.select_len % self.stride:
            raise ValueError(f"NSASizes: stride={self.stride} must divide block_len={self.block_len} and "
                             f"select_len={self.select_len}")
        if self.num_selected < FORCED:
            raise ValueError(f"NSASizes: num_selected={self.num_selected}; expected at least {FORCED} (the initial "
                             "block and the two local blocks are always selected)")


def compressed_ends(pos: Int[Array, "B T"], block_len: int, stride: int) -> Bool[Array, "B T"]:
    """True at the slots where a compressed block ends: document position p >= l - 1, p - l + 1 a multiple of d."""
    return (pos >= block_len - 1) & ((pos - block_len + 1) % stride == 0)


def overlap_in_strides(starts, block_len: int, select_len: int, stride: int, num_blocks: int):
    """(..., num_blocks): the overlap of compressed blocks starting at document positions `starts`
    with each selection block j, [j l', (j + 1) l'), in strides d (eq. 9's weights). numpy or jax."""
    xp = jnp if isinstance(starts, jax.Array) else np
    lo = xp.arange(num_blocks) * select_len
    s = starts[..., None]
    return xp.clip(xp.minimum(s + block_len, lo + select_len) - xp.maximum(s, lo), 0, None) / stride


def select_blocks(score: Float[Array, "*L N"], cur: Int[Array, "*L"], num_selected: int) -> Int[Array, "*L n"]:
    """The num_selected blocks of each query: block 0 and blocks cur - 1, cur always, then the highest
    scores among blocks 1..cur - 2 (ties to the lower block); -1 where fewer blocks exist."""
    j = jnp.arange(score.shape[-1])
    c = cur[..., None]
    forced = (j == 0) | (j == c) | (j == c - 1)
    score = jnp.where(forced, jnp.inf, jnp.where(j <= c, lax.stop_gradient(score), -jnp.inf))
    value, index = lax.top_k(score, min(num_selected, score.shape[-1]))
    return jnp.where(value > -jnp.inf, index, -1).astype(jnp.int32)


def masked_attention(qg, k, v, mask, scale):
    """qg (B, G, R, T, K), k/v (B, S, G, K|V), mask (B, G|1, R|1, T, S) -> o (B, G, R, T, V) float32 and the
    probabilities (B, G, R, T, S); rows that see nothing give zeros."""
    s = jnp.einsum("BGRTK,BSGK->BGRTS", qg, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(mask, s, NEG), axis=-1) * jnp.any(mask, axis=-1, keepdims=True)
    return jnp.einsum("BGRTS,BSGV->BGRTV", p, v.astype(jnp.float32)), p


def nsa_select(q, k_cmp, sizes: NSASizes, *, segment_ids=None, scale=None):
    """Each query's selected blocks (B, T, G, n), from the definition."""
    return _compressed(q, k_cmp, None, sizes, segment_ids, scale)[2]


def _compressed(q, k_cmp, v_cmp, sizes: NSASizes, segment_ids, scale):
    bl, d, ls, n = sizes.block_len, sizes.stride, sizes.select_len, sizes.num_selected
    B, T, H, K = q.shape
    G = k_cmp.shape[2]
    scale = K ** -0.5 if scale is None else scale
    pos = positions_in_document(segment_ids, B, T)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    t = jnp.arange(T)
    same = (seg[:, :, None] == seg[:, None, :]) & (t[None, None, :] <= t[None, :, None])  # (B, T, S)
    mask = (same & compressed_ends(pos, bl, d)[:, None, :])[:, None, None]  # (B, 1, 1, T, S)
    qg = jnp.moveaxis(q.reshape(B, T, G, H // G, K), 1, 3)  # (B, G, R, T, K)
    o, p = masked_attention(qg, k_cmp, k_cmp if v_cmp is None else v_cmp, mask, scale)
    N = -(-T // ls)
    weight = overlap_in_strides(pos - bl + 1, bl, ls, d, N)  # (B, S, N): compressed block ending at s, block j
    score = jnp.einsum("BGRTS,BSN->BTGN", p, weight)  # summed over the group's heads
    selected = select_blocks(score, jnp.broadcast_to((pos // ls)[:, :, None], (B, T, G)), n)
    return o, same, selected, qg, pos, scale


def nsa_reference(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G V"],
    k_cmp: Float[Array, "B T G K"],
    v_cmp: Float[Array, "B T G V"],
    gates: Float[Array, "B T H 3"],
    sizes: NSASizes,
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    scale: float | None = None,
    selected: Int[Array, "B T G n"] | None = None,
) -> Float[Array, "B T H V"]:
    """gates: g^cmp, g^slc, g^win in [0, 1]. selected: each query's blocks (nsa_select), None = chosen here."""
    B, T, H, _ = q.shape
    G = k.shape[2]
    o_cmp, same, chosen, qg, pos, scale = _compressed(q, k_cmp, v_cmp, sizes, segment_ids, scale)
    selected = chosen if selected is None else selected
    blocks = (pos // sizes.select_len)[:, None, None, None, :]  # (B, 1, 1, 1, S): each key's selection block
    in_selected = jnp.any(selected[..., None] == blocks, axis=-2)  # (B, T, G, S)
    o_slc, _ = masked_attention(qg, k, v, (jnp.moveaxis(in_selected, 2, 1) & same[:, None])[:, :, None], scale)
    t = jnp.arange(T)
    in_window = t[None, :] > t[:, None] - sizes.window  # (T, S)
    o_win, _ = masked_attention(qg, k, v, (same & in_window)[:, None, None], scale)
    o = jnp.stack([o_cmp, o_slc, o_win], axis=-1)  # (B, G, R, T, V, 3)
    g = jnp.moveaxis(gates.astype(jnp.float32).reshape(B, T, G, H // G, 3), 1, 3)[..., None, :]  # (B, G, R, T, 1, 3)
    o = jnp.sum(o * g, axis=-1)
    return jnp.moveaxis(o, 3, 1).reshape(B, T, H, -1).astype(q.dtype)
