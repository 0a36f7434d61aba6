"""The mini-batch layout of the test-time-training ops (kernels/ttt, kernels/titans): the inner loop takes
every gradient of a mini-batch at the weights of its start; mini-batches are C tokens counted inside each
document (a document start begins a new one) and a call may begin inside one (pos0 tokens in). The dual
and chunk forms walk the call in chunks of C tokens with lax.scan; these helpers lay the inputs out."""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from kernels.segments import document_starts, positions_in_document


def layout(segment_ids: Int[Array, "B T"] | None, B: int, T: int, C: int, pos0: Int[Array, " B"]
           ) -> tuple[Bool[Array, "B T"], Int[Array, "B T"], Int[Array, "B T"]]:
    """(document starts, position in the mini-batch, the mini-batch's number in the call), each (B, T)."""
    starts = jnp.zeros((B, T), bool) if segment_ids is None else document_starts(segment_ids)
    p = positions_in_document(segment_ids, B, T, start=pos0) % C
    m = jnp.cumsum((p == 0) | (jnp.arange(T) == 0)[None], axis=1, dtype=jnp.int32)
    return starts, p, m


def in_chunks(a: Array, C: int, value=0) -> Array:
    """a (B, T, ...) padded with `value` to whole chunks of C tokens: (n, B, C, ...)."""
    B, T = a.shape[:2]
    n = -(-T // C)
    a = jnp.pad(a, ((0, 0), (0, n * C - T)) + ((0, 0),) * (a.ndim - 2), constant_values=value)
    return jnp.moveaxis(a.reshape(B, n, C, *a.shape[2:]), 1, 0)


def heads_in_chunks(a: Array, C: int) -> Array:
    """a (B, T, H, ...) as float32 chunks (n, B, H, C, ...)."""
    return jnp.swapaxes(in_chunks(a.astype(jnp.float32), C), 2, 3)


def row_kinds(m: Int[Array, "B C"], st: Bool[Array, "B C"]) -> tuple[Bool[Array, "B C"], ...]:
    """A chunk's rows by the start their mini-batch reads, from the mini-batch numbers m and the document
    starts st: (restarted: a document started in the chunk at or before the row, so the learned start;
    carried: the scan's carried mini-batch; nxt: the carried document's next one), each (B, C)."""
    restarted = jnp.cumsum(st, axis=1) > 0
    carried = (m == m[:, :1]) & ~restarted
    return restarted, carried, ~carried & ~restarted


def by_kind(carried: Bool[Array, "B C"], nxt: Bool[Array, "B C"], a_c: Array, a_n: Array, a_0: Array) -> Array:
    """Each row (axis 2 of (B, H, C, ...)) from its kind's array: the carried, next or restarted one. A select,
    not a sum of one-hot products: an array a row does not read cannot reach it, not even where it overflowed
    (the sum gave NaN in every row under jit)."""
    c, n = carried[:, None, :, None], nxt[:, None, :, None]  # (B, 1, C, 1)
    return jnp.where(c, a_c, jnp.where(n, a_n, a_0))


def last_tokens(T: int, C: int) -> Int[Array, " n"]:
    """Each chunk's last real token (the last chunk may be padded)."""
    return jnp.full((-(-T // C),), C - 1, jnp.int32).at[-1].set((T - 1) % C)
