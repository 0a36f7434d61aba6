"""Helpers for packed sequences: `segment_ids` (B, T) int32 mark which document each token is in.

Conventions shared by every op and layer:
- a recurrence resets to a zero state at t >= 1 where segment_ids[t] != segment_ids[t - 1];
- token 0 of a call always continues the state passed in (a zero state in training), so a decode
  step never needs the previous token's segment id;
- attention lets a query see a key only when both have the same segment id.

`scan_documents` is the token-by-token scan every reference form runs on these conventions.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def document_starts(segment_ids: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """True at t >= 1 where a new document starts; always False at t = 0."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(change, ((0, 0), (1, 0)))


def document_index(segment_ids: Int[Array, "B T"] | None, batch: int, length: int,
                   start: Int[Array, " B"] | None = None) -> Int[Array, "B T"]:
    """Number of document starts at or before t, counted from `start` (default 0), the number of the
    document the incoming state belongs to: a running document number per token."""
    index = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else \
        jnp.cumsum(document_starts(segment_ids), axis=1, dtype=jnp.int32)
    return index if start is None else start[:, None] + index


def positions_in_document(segment_ids: Int[Array, "B T"] | None, batch: int, length: int,
                          start: Int[Array, " B"] | None = None) -> Int[Array, "B T"]:
    """Position of each token inside its document: counts up from `start` (default 0) and restarts
    at 0 at every document start. Used for rotary positions, so that packed documents see the same
    positions as when run alone."""
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    start = jnp.zeros((batch,), jnp.int32) if start is None else start.astype(jnp.int32)
    pos = jnp.broadcast_to(t + start[:, None], (batch, length))
    if segment_ids is None:
        return pos
    # The index of the latest document start at or before t, or -1 if none in this call.
    starts = jnp.where(document_starts(segment_ids), t, -1)
    last_start = jax.lax.cummax(starts, axis=1)
    return jnp.where(last_start >= 0, t - last_start, pos)


def entering_state(initial_state: Float[Array, "..."] | None, shape: tuple) -> Float[Array, "..."]:
    """The state before token 0 in float32: `initial_state`, or zeros of `shape` when it is None."""
    return jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)


def scan_inputs(arrays: tuple, D: Array | None, segment_ids: Int[Array, "B T"] | None,
                initial_state: Float[Array, "..."] | None, state_shape: tuple):
    """The inputs a state-space op passes its forms: `arrays` (the first (B, T, ...)) and D (or None)
    in float32, the document starts (B, T) (all False without segment_ids) and the `entering_state`."""
    B, T = arrays[0].shape[:2]
    starts = jnp.zeros((B, T), bool) if segment_ids is None else document_starts(segment_ids)
    args = [a.astype(jnp.float32) for a in arrays] + [None if D is None else D.astype(jnp.float32)]
    return args, starts, entering_state(initial_state, state_shape)


def scan_documents(step, state: Float[Array, "B ..."] | tuple, xs: tuple, segment_ids: Int[Array, "B T"] | None = None,
                   fresh: tuple | None = None):
    """lax.scan of `step(S, *x_t) -> (o_t, S)` over time, with S (an array or a tuple of them) set to `fresh` (a
    tree like S; zeros when None) before the step at every document start. xs: arrays (B, T, ...), or None (passed
    to step as None). Returns (o (B, T, ...), final S)."""
    B, T = next(x for x in xs if x is not None).shape[:2]
    starts = jnp.zeros((B, T), bool) if segment_ids is None else document_starts(segment_ids)
    fresh = jax.tree.map(jnp.zeros_like, state) if fresh is None else fresh

    def body(S, x_t):
        *x_t, start_t = x_t
        S = jax.tree.map(lambda s, s0: jnp.where(start_t.reshape((B,) + (1,) * (s.ndim - 1)), s0, s), S, fresh)
        o_t, S = step(S, *x_t)
        return S, o_t

    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # (T, B, ...)
    state, o = jax.lax.scan(body, state, tuple(map(time_major, (*xs, starts))))
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), o), state
