"""The mixer protocol (layers/__init__.py) in one place: `SequenceMixer`, the base of every sequence mixer
and stateful FFN, holds what they all do alike, so that a layer writes only what is its own.

A layer writes `init_state(batch_size, max_len)` and `_mix(x, state, segment_ids, mode, steps) -> (y, state)`,
its one pass from a state in the form `mode`, and inherits:

- `__call__(x, *, segment_ids=None)`: the training path, `_mix` from a fresh state in the layer's `mode`;
- `decode(x, state, *, segment_ids=None, steps=False)`: `_mix` from `state` in `step_mode` for one token
  or steps=True (which runs token by token, layers/state.py), `prefill_mode` for T > 1 tokens;
- `rollback(stepped, drop)`: layers/state.py's rollback, every field of a stepped state taken at its step;
- the checks at the edge, before any work (`_check`): x (B, T, d_model), segment_ids (B, T), and no
  segment_ids with steps=True.

A layer whose training path is not a decode from a fresh state (attention and the other caches, whose
training pass reads no cache) writes its own `__call__` and `decode`, and calls `_check` first; a cache
that refuses to overflow outside jit calls `_check_room`.
"""

import jax
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from layers.shapes import check_input
from layers.state import rollback


class SequenceMixer(nnx.Module):
    """The mixer protocol's shared methods (module docstring); a subclass sets `d_model` and, where it has
    several exact forms, `mode`."""

    grows_with_context = False  # True where the state grows with max_len (a KV cache)
    # True where the training path splits along time over a mesh's context axis (kernels/context.py): every op that
    # carries information along time has a context-parallel form, and the rest is per token
    context_parallel = False
    mode = None  # the training path's form, for a layer that has several
    step_mode, prefill_mode = "recurrent", "chunk"  # decode's forms: one token or steps=True, T > 1 tokens

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        self._check(x, segment_ids)
        return self._mix(x, self.init_state(x.shape[0], x.shape[1]), segment_ids, self.mode, False)[0]

    def decode(self, x: Float[Array, "B T D"], state, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T D"], object]:
        """Continue from `state` (prefill or T = 1 steps alike); steps=True returns the state after every
        token, for `rollback` (layers/state.py)."""
        self._check(x, segment_ids, steps)
        return self._mix(x, state, segment_ids, self._decode_mode(x.shape[1], steps), steps)

    def rollback(self, stepped, drop: Int[Array, " B"]):
        return rollback(stepped, drop)

    def _decode_mode(self, T: int, steps: bool) -> str:
        return self.step_mode if steps or T == 1 else self.prefill_mode

    def _check(self, x, segment_ids, steps: bool | None = None):
        """x (B, T, d_model) and segment_ids (B, T) or None; `steps` given: decode's checks, which also refuse
        segment_ids with steps=True (a verify pass continues one document per row)."""
        where = type(self).__name__ + ("" if steps is None else ".decode")
        check_input(x, self.d_model, segment_ids, where)
        if steps and segment_ids is not None:
            raise ValueError(f"{where}: steps=True needs segment_ids=None (a verify pass continues one document per "
                             "row)")

    def _check_room(self, index: Int[Array, " B"], T: int, slots: int):
        """Refuse T more tokens in a cache of `slots` slots whose rows hold `index` (B,) tokens. T and slots are
        static, so T > slots raises under jit too (the cache's writes could not even be traced); how many tokens
        the rows hold is known only outside jit, and under it the cache's `overflowed()` says an overflow."""
        name = type(self).__name__
        n = None if isinstance(index, jax.core.Tracer) else int(np.max(index))  # traced (jit, scan): no value
        if n is None and T > slots:
            raise ValueError(f"{name}.decode: {T} new tokens exceed max_len={slots} (under jit, whatever is cached)")
        if n is not None and n + T > slots:
            raise ValueError(f"{name}.decode: {n} cached + {T} new tokens exceed max_len={slots}")
