"""The values that say, beside q, k and v, which keys each query sees: every form of the op takes them.

- `Band`: the band of keys per query head (reference.py's window, sinks, dilation and growth), one
  number for every head or one per query head; static (Python numbers, tuples) as the layers give it,
  or traced arrays (a calibration loop runs many candidate masks through one compiled function).
  It is configuration, not a pytree: built inside a jitted function when its fields are traced.
- `Tokens`: where the queries and keys sit when they are not the same T tokens of one sequence (a
  KV cache, a decode step, queries at chosen positions): their positions, the keys' documents, the
  queries' positions inside their documents and the keys' own decay. A pytree of arrays.
- `CacheView`: a KV cache as `attention_cached` reads it (its keys, values, lengths, documents, slot
  positions and decay). A pytree of arrays.
"""

import dataclasses
import numbers

import jax
from jaxtyping import Array, Float, Int

NO_WINDOW = 2 ** 30  # a head's window when it has none


@dataclasses.dataclass(frozen=True)
class Band:
    """Which keys query head h sees by distance d = p_i - p_j (reference.py gives the rule): the last
    window_h of every dilation_h-th key, a span growing by growth_h per token of the query's document,
    and its document's first sinks_h keys. Each field is one value for every head or per query head
    (H,): a tuple or an array. Per head, window 2**30 is no window, sinks 0, dilation 1 and growth 0
    are none; Band() sees every key."""

    window: int | tuple | Int[Array, "*_H"] | None = None  # (H,) or () arrays; None: every earlier key
    sinks: int | tuple | Int[Array, "*_H"] | None = 0  # None: none, as 0
    dilation: int | tuple | Int[Array, "*_H"] | None = 1  # None: none, as 1
    growth: float | tuple | Float[Array, "*_H"] | None = 0.0  # None: none, as 0

    def terms(self) -> tuple:
        """(window, sinks, dilation, growth) with None for a part no head has: a window of None, and a
        shared static sinks 0, dilation 1 or growth 0 (or None); tuples and arrays as given."""
        none = lambda x, neutral: None if x is None or isinstance(x, numbers.Real) and x == neutral else x
        return self.window, none(self.sinks, 0), none(self.dilation, 1), none(self.growth, 0.0)

    def is_static(self) -> bool:
        """Whether every field is None, a number or a tuple of numbers, as the Pallas kernels take it."""
        static = lambda x: all(isinstance(v, numbers.Real) for v in (x if isinstance(x, tuple) else
                                                                    () if x is None else (x,)))
        return all(map(static, self.terms()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
    """Where the queries and keys sit, each field None for `attention`'s default (self-attention: the
    T queries are the last T of the S keys, in the documents of segment_ids)."""

    q_positions: Int[Array, "#B T"] | None = None  # default: S - T .. S - 1 (rows of 1 broadcast)
    kv_positions: Int[Array, "#B S"] | None = None  # default: 0 .. S - 1
    kv_segment_ids: Int[Array, "B S"] | None = None  # the keys' documents; default: segment_ids
    # The queries' positions inside their documents, which sinks and growth count from; default: from
    # each document's start for packed self-attention (default positions, T = S), else q_positions.
    q_doc_positions: Int[Array, "#B T"] | None = None
    kv_decay: Float[Array, "B S H"] | None = None  # the keys' decay (float32); default: decay


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """A KV cache, heads first, as `attention_cached` reads it: slots [0, length[b]) of row b hold its
    earlier tokens (slot s at position s, unless `positions` says otherwise)."""

    k: Float[Array, "B G S K"]
    v: Float[Array, "B G S V"]
    length: Int[Array, " B"]  # int32, tokens held per row (a scalar broadcasts)
    segment_ids: Int[Array, "B S"] | None = None  # each slot's document (needed with the queries' segment_ids)
    # Each slot's position, for a cache whose slots are not in position order (a ring buffer); a slot
    # whose position is negative or at least length[b] is unwritten (or stale) and never seen.
    positions: Int[Array, "B S"] | None = None
    decay: Float[Array, "B H S"] | None = None  # each slot's decay, float32
