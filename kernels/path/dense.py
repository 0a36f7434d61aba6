"""PaTH attention by blocks of C tokens against a cache of transformed keys: the exact O(T S (K + C)) form that
trains and decodes (kernels/path/__init__.py has the equations; reference.py the truth).

The cache (`PathSlots`) holds each earlier key carried through every factor H_t up to the block's start; a
block then needs only its own factors, in the UT (WY) form of DeltaNet's chunks. Within a block, with the
Gram matrix M_tu = β_u w_t.w_u of tokens of one document,

    walking a query back:   a_i = (I + triu(M, 1))^{-1} (m_i ∘ W q_i),  m_it = [t <= i, same document]
                            q_i <- q_i - Σ_t β_t a_it w_t         (= H_{start} ... H_i q_i, its own document's)
    walking a key forward:  b_j = (I + tril(M, -1))^{-1} (m_j ∘ W k_j), m_jt = [t > j, same document]
                            k_j <- k_j - Σ_t β_t b_jt w_t          (= H_{end} ... H_{j+1} k_j)

(a triangular system per query or key, because each factor's coefficient w_t.x depends on the factors applied
before it; the inverse of a leading block of a triangular matrix is the leading block of its inverse, so one
inverse per block serves every query and key: a mask in the right-hand side starts or stops the walk, and a
document mask in M keeps the documents' systems apart). The logits within the block are
s_ij = q_i.k_j - Σ_{t > j} a_it β_t w_t.k_j; against the cache, the walked-back query dotted with the cached keys.
One softmax (max trick, float32) over both. The cache's keys of each document are then walked through the
block's factors of that document, and the block's keys, walked to the block's end, are written after them.

Training runs this from an empty cache of T slots, block after block (a lax.scan); a decode call from the KV
cache, its T tokens in blocks of at most C (a step, T = 1, costs O(S K): the paper's k_j <- H_t k_j).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.attention import write_rows
from kernels.linalg import unit_lower_inverse


def _block(q, k, v, w, beta, doc, decay, slots, start, scale):
    """One block (tokens (B, C, ...), float32) after `start` (B,) slots: (o (B, C, H, V), the slots' keys walked
    through the block (B, G, S, K), the block's keys walked to its end (B, G, C, K))."""
    B, C, H, K = q.shape
    G, S = slots.k.shape[1:3]
    R = H // G
    qh = jnp.moveaxis(q.reshape(B, C, G, R, K), 1, 3)  # (B, G, R, C, K)
    kh, vh, wh = (jnp.moveaxis(a, 1, 2) for a in (k, v, w))  # (B, G, C, K|V)
    bh = jnp.moveaxis(beta, 1, 2)  # (B, G, C)
    same = doc[:, :, None] == doc[:, None, :]  # (B, C, C)
    lower = jnp.tril(jnp.ones((C, C), bool), -1)
    n = jnp.where(lower & same[:, None], jnp.einsum("bgtk,bguk->bgtu", wh, wh), 0.0)  # N = tril(w_t.w_u, -1)
    fwd = unit_lower_inverse(-n * bh[:, :, None, :])  # (I + N D)^{-1} = (I + tril(M, -1))^{-1}, D = diag(β)
    upto = ~lower.T[None] & same  # (B, C, C): [i, t] = t <= i, same document
    rhs = jnp.einsum("bgrik,bgtk->bgrit", qh, wh) * upto[:, None, None]
    # the walk back solves (I + N^T D) a_i = rhs_i, a_i^T = rhs_i^T (I + D N)^{-1} = rhs_i^T (I - D (I + N D)^{-1} N)
    # (push-through identity): the one inverse serves both walks
    a = rhs - jnp.einsum("bgrit,bgtu,bguv->bgriv", rhs * bh[:, :, None, None], fwd, n)
    a = a * bh[:, :, None, None]  # β_t a_it
    q_back = qh - jnp.einsum("bgrit,bgtk->bgrik", a, wh)  # walked back to the block's start
    wk = jnp.einsum("bgtk,bgjk->bgtj", wh, kh) * (lower & same)[:, None]  # [t, j] = w_t.k_j, t > j
    s_in = jnp.einsum("bgrik,bgjk->bgrij", qh, kh) - jnp.einsum("bgrit,bgtj->bgrij", a, wk)  # (B, G, R, C, C)
    s_out = jnp.einsum("bgrik,bgsk->bgris", q_back, slots.k)  # (B, G, R, C, S)
    seen_in = (~lower.T[None] & same)[:, None, None]  # (B, 1, 1, C, C): j <= i, same document
    written = (jnp.arange(S)[None] < start[:, None])[:, None]  # (B, 1, S)
    seen_out = (written & (slots.doc[:, None] == doc[:, :, None]))[:, None, None]  # (B, 1, 1, C, S)
    if decay is not None:
        c = jnp.moveaxis(decay.reshape(B, C, G, R), 1, 3)  # (B, G, R, C)
        s_in = s_in + c[..., :, None] - c[..., None, :]
        s_out = s_out + c[..., :, None] - slots.decay.reshape(B, G, R, 1, S)
    s_in = jnp.where(seen_in, scale * s_in, -jnp.inf)
    s_out = jnp.where(seen_out, scale * s_out, -jnp.inf)
    m = jnp.maximum(s_in.max(-1), s_out.max(-1))[..., None]  # finite: a query always sees its own key
    p_in, p_out = jnp.exp(s_in - m), jnp.exp(s_out - m)
    o = (jnp.einsum("bgrij,bgjv->bgriv", p_in, vh) + jnp.einsum("bgris,bgsv->bgriv", p_out, slots.v)) \
        / (p_in.sum(-1) + p_out.sum(-1))[..., None]  # (B, G, R, C, V)
    o = jnp.moveaxis(o, 3, 1).reshape(B, C, H, -1)  # (B, C, H, V)

    def walk(x, mask):  # x (B, G, N, K) through the block's factors t with mask (B, N, C)
        b = jnp.einsum("bgnu,bgtu->bgnt", jnp.einsum("bgnk,bgtk->bgnt", x, wh) * mask[:, None], fwd)
        return x - jnp.einsum("bgnt,bgt,bgtk->bgnk", b, bh, wh)

    mask = jnp.concatenate([slots.doc[:, :, None] == doc[:, None, :], lower.T[None] & same], axis=1)  # (B, S+C, C)
    keys = walk(jnp.concatenate([slots.k, kh], axis=2), mask)  # (B, G, S+C, K): [j, t] = t > j for the block's
    return o, keys[:, :, :S], keys[:, :, S:]


def path_blocks(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                w: Float[Array, "B T G K"], beta: Float[Array, "B T G"], doc: Int[Array, "B T"],
                decay: Float[Array, "B T H"] | None, slots, index: Int[Array, " B"], scale: float, chunk_size: int):
    """The T tokens after each row's `index` cached tokens in blocks of min(chunk_size, T): (o (B, T, H, V)
    float32, the slots after them, a kernels.path.PathSlots in the dtypes it came in)."""
    B, T = q.shape[:2]
    S = slots.k.shape[2]
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    xs = [f32(a) for a in (q, k, v, w, beta, decay)] + [doc]
    state = type(slots)(k=f32(slots.k), v=f32(slots.v), doc=slots.doc, decay=f32(slots.decay))
    if pad:  # padding tokens of no document (-1) and no factor (β = 0), written to padding slots, then dropped
        xs = [None if a is None else jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2),
                                              constant_values=-1 if a.dtype == jnp.int32 else 0) for a in xs]
        grow = lambda a, axis, fill=0: None if a is None else jnp.pad(
            a, [(0, pad) if d == axis else (0, 0) for d in range(a.ndim)], constant_values=fill)
        state = type(slots)(k=grow(state.k, 2), v=grow(state.v, 2), doc=grow(state.doc, 1, -1),
                            decay=grow(state.decay, 2))

    def step(state, inputs):
        *blk, n = inputs
        qb, kb, vb, wb, bb, cb, db = blk
        start = index + n * C
        o, keys, own = _block(qb, kb, vb, wb, bb, db, cb, state, start, scale)
        write = lambda a, new, axis: None if a is None else write_rows(a, new, start, axis)
        state = type(slots)(k=write(keys, own, 2), v=write(state.v, jnp.moveaxis(vb, 1, 2), 2),
                            doc=write(state.doc, db, 1), decay=write(state.decay, None if cb is None else
                                                                      jnp.moveaxis(cb, 1, 2), 2))
        return state, o

    if N == 1:
        state, o = step(state, (*xs, 0))
    else:
        blocks = [None if a is None else jnp.moveaxis(a.reshape(B, N, C, *a.shape[2:]), 1, 0) for a in xs]
        state, o = jax.lax.scan(step, state, (*blocks, jnp.arange(N)))  # o (N, B, C, H, V)
        o = jnp.moveaxis(o, 0, 1).reshape(B, N * C, *o.shape[3:])[:, :T]  # (B, T, H, V)
    cut = lambda a, axis, like: None if a is None else jax.lax.slice_in_dim(a, 0, S, axis=axis).astype(like.dtype)
    return o, type(slots)(k=cut(state.k, 2, slots.k), v=cut(state.v, 2, slots.v), doc=cut(state.doc, 1, slots.doc),
                          decay=cut(state.decay, 2, slots.decay) if slots.decay is not None else None)
