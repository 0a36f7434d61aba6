"""MoBA in XLA, impl="xla" (and "auto"): two forms of reference.py's function.

- `moba_dense` (T <= DENSE_T): the blocks chosen from window sums (below), then the reference's
  masked dense softmax over the (T, S) scores, which XLA on CPU runs fastest at training lengths;
- `moba_gathered` (longer T): no (T, S) scores, each query gathers the keys of its selected blocks.

MoBA selects per query and per head, so no two queries need share a key tile; this form therefore
works per query: it gathers the mean-pooled key of each earlier block of the query's document (the
gate: N dot products per head), takes the top_k - 1, gathers those blocks' keys and values and its
own block's, and runs one softmax over the (top_k - 1) b + b keys. Work per query is N K + top_k b
(K + V) against the dense form's S (K + V); memory per query the gathered (top_k - 1) b keys of each
head. Queries run in chunks of CHUNK under `lax.map` with `jax.checkpoint`, so neither pass ever
holds more than one chunk's gathered keys (the backward recomputes the gathers); the gradient of a
gather is XLA's scatter-add into k and v.

The pooled keys come from window sums, w_s = sum_{j < b} k_{s + j}: a block of a document starting
at slot a is n's pooled key w_{a + n b} / b, blocks counted from each document's start as in
reference.py. `attend_blocks` serves decode too (layers/moba.py), where the keys are a KV cache.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from kernels.moba.reference import moba_reference, select_blocks
from kernels.segments import positions_in_document

NEG = -1e30  # finite: masked scores give exactly zero weight without NaN in the backward
CHUNK = 64  # queries per lax.map step
# Up to this T the masked dense form (reference.py's, with the blocks chosen from the window sums) is
# faster on CPU: fwd+bwd at B=16, T=128, H=4, K=32, b=16, top_k=3: dense 24 ms, gathered 296 ms; at
# B=1, T=1024, H=8, b=64: dense 586 ms, gathered 389 ms (the gathers' scatter-add backward dominates).
DENSE_T = 512


def take(xt, slots):
    """xt (B, G, S, K) gathered at slots (B, G, ...) -> (B, G, ..., K); slots clipped to [0, S)."""
    slots = jnp.clip(slots, 0, xt.shape[2] - 1)
    return jax.vmap(jax.vmap(lambda x, s: x[s]))(xt, slots)


def _by_group(x, G: int):
    """(B, Q, H, ...) -> (B, G, Q, R, ...): a query head's kv group first."""
    B, Q, H = x.shape[:3]
    return jnp.moveaxis(x.reshape(B, Q, G, H // G, *x.shape[3:]), 2, 1)


def attend_blocks(q: Float[Array, "B Q H K"], kt: Float[Array, "B G S K"], vt: Float[Array, "B G S V"],
                  q_slot: Int[Array, "B Q"], start: Int[Array, "B Q"], selected: Int[Array, "B Q H _k"],
                  block_size: int, scale: float, own=None) -> Float[Array, "B Q H V"]:
    """Each query's attention over its selected blocks (slots start + n b + [0, b), n >= 0) and its
    own block (start + c b + [0, b) up to q_slot, c = (q_slot - start) // b), one softmax.
    kt, vt heads first. own = (k, v) of the queries themselves (B, Q, G, K|V): the keys then hold only
    the slots before each query (a decode step reads its cache before writing it)."""
    B, Q, H, K = q.shape
    G, b = kt.shape[1], block_size
    qg = _by_group(q, G)  # (B, G, Q, R, K)
    span = jnp.arange(b, dtype=jnp.int32)
    sel = _by_group(selected, G)  # (B, G, Q, R, k)
    sel_slots = start[:, None, :, None, None, None] + sel[..., None] * b + span  # (B, G, Q, R, k, b)
    own_slots = start + (q_slot - start) // b * b  # (B, Q)
    own_slots = jnp.broadcast_to((own_slots[:, :, None] + span)[:, None], (B, G, Q, b))  # (B, G, Q, b)
    last = q_slot if own is None else q_slot - 1
    own_seen = (own_slots <= last[:, None, :, None])[:, :, :, None]  # (B, G, Q, 1, b)
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    s_sel = dot("BGQRK,BGQRNJK->BGQRNJ", qg, take(kt, sel_slots)) * scale
    s_sel = jnp.where(sel[..., None] >= 0, s_sel, NEG).reshape(*sel.shape[:4], -1)  # (B, G, Q, R, k b)
    s_own = jnp.where(own_seen, dot("BGQRK,BGQJK->BGQRJ", qg, take(kt, own_slots)) * scale, NEG)  # (B, G, Q, R, b)
    parts = [s_sel, s_own]
    if own is not None:
        parts.append(dot("BGQRK,BGQK->BGQR", qg, jnp.moveaxis(own[0], 2, 1))[..., None] * scale)  # (B, G, Q, R, 1)
    p = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    n_sel = s_sel.shape[-1]
    vf = lambda x: x.astype(jnp.float32)
    o = dot("BGQRNJ,BGQRNJV->BGQRV", p[..., :n_sel].reshape(s_sel.shape[:4] + sel_slots.shape[-2:]),
            vf(take(vt, sel_slots)))
    o = o + dot("BGQRJ,BGQJV->BGQRV", p[..., n_sel:n_sel + b], vf(take(vt, own_slots)))
    if own is not None:
        o = o + p[..., -1:] * vf(jnp.moveaxis(own[1], 2, 1))[:, :, :, None]
    return jnp.moveaxis(o, 1, 2).reshape(B, Q, H, -1).astype(q.dtype)  # (B, Q, H, V)


def pooled_gate(q: Float[Array, "B Q H K"], pooled: Float[Array, "B G Q N K"], cur: Int[Array, "B Q"],
                block_size: int) -> Float[Array, "B Q H N"]:
    """q . (block sums / b) against each query's N blocks; -inf at blocks n >= cur (not yet complete)."""
    B, Q, H, K = q.shape
    qg = _by_group(q, pooled.shape[1]).astype(jnp.float32)  # (B, G, Q, R, K)
    gate = jnp.einsum("BGQRK,BGQNK->BGQRN", qg, pooled / block_size)
    gate = jnp.moveaxis(gate, 1, 2).reshape(B, Q, H, -1)  # (B, Q, H, N)
    earlier = jnp.arange(gate.shape[-1])[None, None, :] < cur[:, :, None]  # (B, Q, N)
    return jnp.where(earlier[:, :, None], gate, -jnp.inf)


def moba_xla(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"], *,
             block_size: int, top_k: int, segment_ids: Int[Array, "B T"] | None = None,
             scale: float | None = None, selected: Int[Array, "B T H _k"] | None = None) -> Float[Array, "B T H V"]:
    """The dense form up to DENSE_T tokens, the gathered form above."""
    form = moba_dense if q.shape[1] <= DENSE_T else moba_gathered
    return form(q, k, v, block_size=block_size, top_k=top_k, segment_ids=segment_ids, scale=scale, selected=selected)


def _chooser(q, k, segment_ids, block_size: int, top_k: int):
    """choose(qc, slot_c, start_c): the blocks chosen by queries qc (B, Q, H, K) at slots slot_c (B, Q) of
    documents starting at start_c, from the window sums at their blocks' first slots; and the (B, T)
    slots and document starts of all queries."""
    B, T, G = k.shape[:3]
    b, N = block_size, -(-T // block_size)
    window = [(0, 0), (0, b - 1), (0, 0), (0, 0)]
    sums = lax.reduce_window(k.astype(jnp.float32), 0.0, lax.add, (1, b, 1, 1), (1, 1, 1, 1), window)  # (B, T, G, K)
    sums = sums.transpose(0, 2, 1, 3)  # (B, G, T, K)

    def choose(qc, slot_c, start_c):
        blocks = start_c[:, None, :, None] + jnp.arange(N, dtype=jnp.int32) * b  # (B, 1, Q, N)
        pooled = take(sums, jnp.broadcast_to(blocks, (B, G, *blocks.shape[2:])))  # (B, G, Q, N, K)
        return select_blocks(pooled_gate(qc, pooled, (slot_c - start_c) // b, b), top_k)

    slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return choose, slot, slot - positions_in_document(segment_ids, B, T)


def moba_dense(q, k, v, *, block_size: int, top_k: int, segment_ids=None, scale=None, selected=None):
    """The blocks chosen from the window sums, then reference.py's masked dense softmax."""
    if selected is None:
        choose, slot, start = _chooser(q, k, segment_ids, block_size, top_k)
        selected = choose(q, slot, start)
    return moba_reference(q, k, v, block_size=block_size, top_k=top_k, segment_ids=segment_ids, scale=scale,
                          selected=selected)


def moba_gathered(q, k, v, *, block_size: int, top_k: int, segment_ids=None, scale=None, selected=None):
    """Per query the gathered keys of its blocks, queries in chunks of CHUNK (see the module docstring)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, G, T, K)
    choose, slot, start = _chooser(q, k, segment_ids, block_size, top_k)
    Q = min(CHUNK, T)
    Tp = -(-T // Q) * Q
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), mode="edge")  # dropped queries
    chunks = lambda x: jnp.moveaxis(pad(x).reshape(B, Tp // Q, Q, *x.shape[2:]), 1, 0)  # (T/Q, B, Q, ...)

    @jax.checkpoint
    def chunk(args):
        qc, slot_c, start_c, sel_c = args
        sel_c = choose(qc, slot_c, start_c) if sel_c is None else sel_c
        return attend_blocks(qc, kt, vt, slot_c, start_c, sel_c, block_size, scale)

    sel = None if selected is None else chunks(selected)
    o = lax.map(chunk, (chunks(q), chunks(slot), chunks(start), sel))  # (T/Q, B, Q, H, V)
    return jnp.moveaxis(o, 0, 1).reshape(B, Tp, H, -1)[:, :T]
