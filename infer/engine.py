"""Serving: an engine that runs a stream of requests on one model, with continuous batching, chunked
prefill and prefix caching of recurrent states and KV blocks.

The engine owns one decode state of `slots` rows (`model.init_state(slots, max_len + chunk)`): each row
is a slot, holding a KV cache row for attention layers and a fixed-size state for recurrent ones. A
request waits in a queue until a slot is free; it is admitted at a step boundary, its row reset to a
fresh state, and its prompt fed `chunk` tokens at a time, up to `prefill_rows` prompts per step, while
the other slots decode one token each. One jitted `step` (per slots, chunk and prefill_rows) does both:

- prefill: the rows' chunks (R, chunk). Full chunks run as one `decode` (each layer's prefill form); a
  prompt's last chunk is shorter, and those run all `chunk` tokens as `decode(..., steps=True)`, each row
  then rolled back to its n real tokens (`rollback`, layers/state.py): how one shape serves every length.
  (A sliding-window attention's ring buffer takes such a call only up to its `ring_spare` tokens, so
  `chunk` must not exceed it.) Rolling back runs a recurrent layer token by token (benchmarks/serve.py
  measures it: Mamba-2 at 3.4 times its chunked form for 32 tokens). With tail="decode" instead, a
  prompt's last fewer-than-`chunk` tokens go through the decode lanes one a step (which run every slot
  anyway): no rollback, and no ring_spare limit, at up to chunk - 1 steps of that request's time to first
  token; which is faster depends on the kind (docs/serving.md);
- decode: every slot's last token (slots, 1), the rows that are not decoding held as they were.

A finished request frees its slot at once; the next request admitted there starts from a reset row,
so nothing of the previous one (a KV row, a recurrent state, a convolution window) can leak.

Prefix caching: a prompt's chunks start at multiples of `chunk` and each chunk boundary is a block
boundary. After a full block of a prompt, the engine keeps a snapshot of the row (`PrefixCache`): that
block's slots of every KV cache (the fields with a slot axis) and the whole recurrent state at the
boundary. A later prompt that starts with the same blocks restores them into its fresh row and feeds
only the rest: its chunks, and so its arithmetic, are exactly those of a run without the cache, and
the outputs are the same bits. Blocks are evicted least-recently-used (leaves of the prefix tree
first) to stay under `prefix_cache_mb`.

Sampling is per request: greedy (temperature 0) or temperature / top-k / top-p with the request's
seed; token i of a request is drawn with `fold_in(key(seed), i)`, as `infer.generate` draws it, so a
request gets exactly the tokens `generate` gives its prompt alone.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import speculative, stops
from infer.generate import DECODE_OPTIONS, Sampling, check_request, sample_logits
from layers.state import hold

TRACES = {"step": 0}  # incremented at trace time: tests check that a step compiles once


@dataclasses.dataclass(frozen=True)
class Request:
    """A completion request: prompt token ids, at most `max_tokens` new tokens, `sampling` with `seed`;
    it ends after `stop_token` (not returned) or at the token that completes one of `stop` (returned,
    as `generate` does: the text is cut with `stop.cut`)."""
    prompt: tuple[int, ...] | list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stop_token: int | None = None
    stop: stops.StopStrings | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    """What a step did for one request: its new tokens and, on its last event, why it ended: "stop" (its
    stop token or a stop string), "length" (max_tokens) or "cancelled"."""
    rid: int
    tokens: list[int]
    finish: str | None = None


@dataclasses.dataclass
class _Slot:
    """A running request, on the host: its prompt tokens fed so far, its generated tokens and its stop
    strings' matcher state."""
    rid: int
    request: Request
    fed: int = 0
    out: list = dataclasses.field(default_factory=list)
    matched: int = 0


def _sample(logits, seed, count, temperature, top_k, top_p):
    """One token per row from float32 logits (N, V) by each row's settings (N,): greedy where temperature is 0,
    else `generate`'s draw for that row alone (top_k 0 and top_p > 1 mean no cut). Each part runs only when
    some row needs it: an all-greedy step draws nothing."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    col = lambda a: a[:, None]

    def top_k_cut(w):
        kth = jnp.take_along_axis(jnp.sort(w)[:, ::-1], col(jnp.maximum(top_k, 1) - 1), 1)  # as lax.top_k's k-th
        return jnp.where(col(top_k > 0) & (w < kth), -jnp.inf, w)

    def draw():
        warped = logits / col(jnp.where(temperature > 0, temperature, 1.0))
        warped = jax.lax.cond(jnp.any(top_k > 0), top_k_cut, lambda w: w, warped)
        nucleus = lambda w: jnp.where(col(top_p <= 1), speculative.warp(w, 1.0, None, col(top_p)), w)
        warped = jax.lax.cond(jnp.any(top_p <= 1), nucleus, lambda w: w, warped)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, count)
        drawn = jax.vmap(lambda key, w: sample_logits(w[None], key, Sampling(jnp.float32(1)))[0])(keys, warped)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)


def _select(keep, new, old):
    """`new` in the rows where keep (N,) is True, `old` in the others, for every array of two like pytrees (all
    fields of a state alike, unlike `hold`)."""
    return jax.tree.map(lambda a, b: jnp.where(keep.reshape(-1, *(1,) * (a.ndim - 1)), a, b), new, old)


def _step(graphdef, rolled_tails: bool, params, state, rows, chunk, n, last, decoding, settings):
    """One engine step: the prefill chunks (R, C) of slots `rows` (n (R,) real tokens each, 0 for an unused
    entry whose row is out of range; below C only with `rolled_tails`), then one decode step of every slot's
    `last` token where `decoding`.
    `settings` = (seed, count, temperature, top_k, top_p), (slots,) each. Returns the state, the token drawn
    after each chunk (R,) and after each decode (slots,), and whether a cache overflowed."""
    TRACES["step"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()
    C = chunk.shape[1]
    at_rows = lambda a: jnp.take(a, rows, axis=0, mode="clip")

    def prefill(state):
        part = jax.tree.map(at_rows, state)  # (R, ...)
        skip = lambda: (jnp.zeros((len(rows), model.cfg.vocab_size), jnp.float32), part)

        def whole():  # full chunks: the prefill form (chunkwise for a recurrent kind)
            logits, new = model.decode(chunk, part)
            return logits[:, -1].astype(jnp.float32), new

        def rolled():  # a prompt's last, shorter chunk: run all C, roll back to its n tokens
            logits, stepped = model.decode(chunk, part, steps=True)
            last = logits[jnp.arange(len(rows)), jnp.maximum(n, 1) - 1]  # (R, V)
            return last.astype(jnp.float32), model.rollback(stepped, C - jnp.maximum(n, 1))

        full, short = n == C, (n > 0) & (n < C)
        tails = _select(short, jax.lax.cond(jnp.any(short), rolled, skip), skip()) if rolled_tails else skip()
        logits, new = _select(full, jax.lax.cond(jnp.any(full), whole, skip), tails)
        state = jax.tree.map(lambda a, r: a.at[rows].set(r, mode="drop"), state, new)
        return state, _sample(logits, *map(at_rows, settings))

    def decode(state):
        logits, new = model.decode(last[:, None], state)
        return hold(decoding, state, new), _sample(logits[:, 0].astype(jnp.float32), *settings)

    state, first = jax.lax.cond(jnp.any(n > 0), prefill, lambda s: (s, jnp.zeros(rows.shape, jnp.int32)), state)
    state, tokens = jax.lax.cond(jnp.any(decoding), decode, lambda s: (s, jnp.zeros(last.shape, jnp.int32)), state)
    return state, first, tokens, model.overflowed(state)


@functools.lru_cache(maxsize=16)
def _compiled_step(graphdef, rolled_tails: bool):
    """`_step` jitted for one model structure: the engine's calls do not hash the graphdef each step."""
    return jax.jit(functools.partial(_step, graphdef, rolled_tails), donate_argnames="state",
                   compiler_options=DECODE_OPTIONS)


@functools.partial(jax.jit, static_argnames=("graphdef", "size"), donate_argnames="state")
def _reset(graphdef, params, state, row, *, size: int):
    """The state with slot `row` set to a fresh one (model.init_state(1, size)'s)."""
    fresh = nnx.merge(graphdef, params).init_state(1, size)
    return jax.tree.map(lambda a, f: a.at[row].set(f[0]), state, fresh)


@functools.partial(jax.jit, static_argnames=("axes", "size"))
def _take_block(state, row, start, *, axes: tuple, size: int) -> list:
    """Slot `row`'s block snapshot: the `size` slots from `start` of each leaf with a slot axis (`axes`, per
    leaf: the axis or None), the whole row of the others."""
    return [a[row] if ax is None else jax.lax.dynamic_slice_in_dim(a[row], start, size, ax - 1)
            for a, ax in zip(jax.tree.leaves(state), axes)]


@functools.partial(jax.jit, static_argnames="axes", donate_argnames="state")
def _put_block(state, row, start, block: list, *, axes: tuple):
    """The state with a `_take_block` snapshot written back into slot `row` at `start`."""
    leaves, tree = jax.tree.flatten(state)
    put = lambda a, b, ax: b if ax is None else jax.lax.dynamic_update_slice_in_dim(a[row], b, start, ax - 1)
    return tree.unflatten([a.at[row].set(put(a, b, ax)) for a, b, ax in zip(leaves, block, axes)])


def slot_axes(model, size: int) -> tuple:
    """Per leaf of `model.init_state`: the axis that counts the cache's slots (its length follows max_len), or
    None for a leaf that does not grow with the context (a recurrent state, a ring buffer, counters)."""
    one, more = (jax.tree.leaves(jax.eval_shape(lambda: model.init_state(1, s))) for s in (size, size + 1))
    return tuple(next((ax for ax, (x, y) in enumerate(zip(a.shape, b.shape)) if (x, y) == (size, size + 1)), None)
                 for a, b in zip(one, more))


@dataclasses.dataclass
class _Block:
    snapshot: list  # `_take_block`'s arrays
    nbytes: int
    parent: bytes | None  # the key of the block before it
    children: int = 0  # cached blocks that continue it


class PrefixCache:
    """Block snapshots keyed by the prompt prefix they end (its token ids' bytes: exact, no hash collisions):
    each holds its block's KV slots and the recurrent state at its end (`_take_block`). Past `budget` bytes the
    least recently used block that no cached block continues goes first, so a cached chain stays whole."""

    def __init__(self, budget: int, block: int):
        self.budget, self.block, self.bytes = budget, block, 0
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # least recently used first
        self.hits = self.lookups = self.reused = 0

    def key(self, prompt, end: int) -> bytes:
        return np.asarray(prompt[:end], np.int32).tobytes()

    def match(self, prompt) -> list[list]:
        """The snapshots of the longest run of cached blocks that starts `prompt`, leaving at least its last
        token to feed (its logits draw the first new token)."""
        found = []
        for end in range(self.block, len(prompt), self.block):
            key = self.key(prompt, end)
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            found.append(self.blocks[key].snapshot)
        self.lookups += 1
        self.hits += bool(found)
        self.reused += len(found) * self.block
        return found

    def add(self, prompt, end: int, snapshot: list):
        """Keep the snapshot of the block of `prompt` that ends at `end`."""
        key = self.key(prompt, end)
        parent = self.key(prompt, end - self.block) if end > self.block else None
        nbytes = sum(a.nbytes for a in snapshot)
        if key in self.blocks or nbytes > self.budget or (parent is not None and parent not in self.blocks):
            return  # cached already, too large, or its chain was evicted meanwhile: no match could reach it
        if parent is not None:
            self.blocks[parent].children += 1
        self.blocks[key] = _Block(snapshot, nbytes, parent)
        self.bytes += nbytes
        while self.bytes > self.budget:
            old = self.blocks.pop(next(k for k, b in self.blocks.items() if b.children == 0))
            self.bytes -= old.nbytes
            if old.parent is not None:
                self.blocks[old.parent].children -= 1


class Engine:
    """Serves requests on `model` (module docstring): `slots` rows of decode state for prompts plus new tokens
    of at most `max_len`, prompts fed `chunk` tokens at a time (a block of the prefix cache), at most
    `prefill_rows` of them per step; `prefix_cache_mb` megabytes of prefix snapshots (0: no prefix cache);
    `tail`: a prompt's last, shorter chunk rolled back ("rollback") or fed through the decode lanes ("decode").

        engine = Engine(model, slots=8)
        rid = engine.submit(Request(prompt=ids, max_tokens=64))
        while not engine.idle:
            for event in engine.step(): ...   # Event(rid, new tokens, finish)
    """

    def __init__(self, model, *, slots: int = 8, max_len: int = 512, chunk: int = 16, prefill_rows: int = 1,
                 prefix_cache_mb: float = 0.0, tail: str = "rollback"):
        if min(slots, max_len, chunk, prefill_rows) < 1 or prefill_rows > slots or prefix_cache_mb < 0 or \
                tail not in ("rollback", "decode"):
            raise ValueError(f"Engine: need slots, max_len, chunk >= 1, 1 <= prefill_rows <= slots, "
                             f"prefix_cache_mb >= 0 and tail rollback or decode; got slots={slots}, max_len={max_len}, "
                             f"chunk={chunk}, prefill_rows={prefill_rows}, prefix_cache_mb={prefix_cache_mb}, "
                             f"tail={tail!r}")
        if model.cfg.head != "lm":
            raise ValueError(f"Engine: model.head={model.cfg.head!r} is not a language model; only model.head=lm "
                             "decodes")
        self.model, self.slots, self.max_len, self.chunk, self.prefill_rows = model, slots, max_len, chunk, prefill_rows
        self.size = max_len + chunk  # a prefill chunk writes all its `chunk` slots before rolling back
        self.graphdef, self.params = nnx.split(model)
        self.state = jax.tree.map(jnp.copy, model.init_state(slots, self.size))  # one buffer per leaf: donated
        self.axes = slot_axes(model, self.size)
        self.slot_bytes = sum(a.nbytes for a in jax.tree.leaves(self.state)) // slots
        self.cache = PrefixCache(int(prefix_cache_mb * 2**20), chunk) if prefix_cache_mb else None
        self.tail = tail
        self.run_step = _compiled_step(self.graphdef, tail == "rollback")
        # Per slot, what the step reads: the last token and whether it decodes; its request's sampling settings
        # (seed, tokens drawn so far, temperature, top_k (0: none), top_p (2: none)).
        self.last, self.decoding = np.zeros((slots,), np.int32), np.zeros((slots,), bool)
        self.settings = (np.zeros((slots,), np.uint32), np.zeros((slots,), np.int32), np.zeros((slots,), np.float32),
                         np.zeros((slots,), np.int32), np.zeros((slots,), np.float32))
        self.queue = collections.deque()  # (rid, request) waiting for a slot
        self.running: list[_Slot | None] = [None] * slots
        self.order: list[int] = []  # slots in the order their requests were admitted: prefill goes first come
        self.cancelled: list[int] = []
        self.next_rid = self.steps = self.generated = self.prefilled = 0

    @property
    def idle(self) -> bool:
        return not self.queue and not self.cancelled and all(s is None for s in self.running)

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. Bad input is a ValueError here, before anything runs."""
        prompt = list(request.prompt)
        check_request([prompt], request.max_tokens, request.sampling, request.stop_token, request.stop,
                      self.model.cfg.vocab_size, "Engine.submit")
        if len(prompt) + request.max_tokens > self.max_len:
            raise ValueError(f"Engine.submit: the prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({request.max_tokens}) is {len(prompt) + request.max_tokens}, more than the engine's "
                             f"max_len={self.max_len}")
        if not 0 <= request.seed < 2**32:
            raise ValueError(f"Engine.submit: seed={request.seed}; expected an integer in [0, 2**32)")
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.queue.append((rid, dataclasses.replace(request, prompt=prompt)))
        return rid

    def cancel(self, rid: int):
        """Drop a request, queued or running (its slot is free at once); the next step reports it."""
        self.queue = collections.deque(q for q in self.queue if q[0] != rid)
        for i, s in enumerate(self.running):
            if s is not None and s.rid == rid:
                self._free(i)
        self.cancelled.append(rid)

    def run(self, requests: list[Request]) -> list[list[int]]:
        """Every request's new tokens, served together (continuous batching when they outnumber the slots)."""
        rids = [self.submit(r) for r in requests]
        out = {rid: [] for rid in rids}
        while not self.idle:
            for e in self.step():
                out[e.rid] += e.tokens
        return [out[rid] for rid in rids]

    def stats(self) -> dict:
        """Numbers for a metrics endpoint."""
        cache = self.cache
        return dict(slots=self.slots, running=sum(s is not None for s in self.running), queued=len(self.queue),
                    steps=self.steps, generated_tokens=self.generated, prefill_tokens=self.prefilled,
                    slot_bytes=self.slot_bytes, prefix_cache_bytes=cache.bytes if cache else 0,
                    prefix_cache_lookups=cache.lookups if cache else 0, prefix_cache_hits=cache.hits if cache else 0,
                    prefix_cache_reused_tokens=cache.reused if cache else 0)

    def _free(self, i: int):
        self.running[i], self.decoding[i] = None, False
        self.order.remove(i)

    def _admit(self):
        """Queued requests into free slots, each row reset (and restored from the prefix cache)."""
        for i in range(self.slots):
            if self.running[i] is not None or not self.queue:
                continue
            rid, request = self.queue.popleft()
            self.state = _reset(self.graphdef, self.params, self.state, i, size=self.size)
            slot = _Slot(rid, request)
            sampling = request.sampling
            for array, value in zip(self.settings, (request.seed, 0, sampling.temperature, sampling.top_k or 0,
                                                    2 if sampling.top_p is None else sampling.top_p)):
                array[i] = value
            for j, block in enumerate(self.cache.match(request.prompt) if self.cache else []):
                self.state = _put_block(self.state, i, j * self.chunk, block, axes=self.axes)
                slot.fed += self.chunk
            self.running[i] = slot
            self.order.append(i)

    def step(self) -> list[Event]:
        """Admit what fits, run one prefill chunk per prefilling slot (up to prefill_rows) and one decode
        step of every decoding slot; returns what happened to each request."""
        events = [Event(rid, [], "cancelled") for rid in self.cancelled]
        self.cancelled = []
        self._admit()
        B, C, R = self.slots, self.chunk, self.prefill_rows
        rows = np.full((R,), B, np.int32)  # B: an unused entry (dropped)
        chunk, n = np.zeros((R, C), np.int32), np.zeros((R,), np.int32)
        left = {i: len(self.running[i].request.prompt) - self.running[i].fed for i in self.order}  # to prefill
        tails = [i for i in self.order if 0 < left[i] < C] if self.tail == "decode" else []
        prefilling = [i for i in self.order if left[i] > 0 and i not in tails][:R]
        for r, i in enumerate(prefilling):
            s = self.running[i]
            piece = s.request.prompt[s.fed:s.fed + C]
            rows[r], n[r], chunk[r, :len(piece)] = i, len(piece), piece
        decoding = self.decoding.copy()
        for i in tails:  # tail="decode": a prompt's last tokens, one a step in the decode lanes
            self.last[i], decoding[i] = self.running[i].request.prompt[self.running[i].fed], True
        if not prefilling and not decoding.any():
            return events
        self.state, *out = self.run_step(self.params, self.state, rows, chunk, n, self.last, decoding, self.settings)
        first, tokens, overflowed = jax.device_get(out)
        if overflowed:
            raise RuntimeError("Engine: a KV cache overflowed its slots; this is a bug in the engine, please report it")
        self.steps += 1
        new = {i: int(tokens[i]) for i in np.flatnonzero(decoding).tolist() if i not in tails}
        for i in tails:
            s = self.running[i]
            s.fed += 1
            self.prefilled += 1
            if s.fed == len(s.request.prompt):  # the last prompt token's logits drew the first new token
                new[i] = int(tokens[i])
        for r, i in enumerate(prefilling):
            s = self.running[i]
            s.fed += int(n[r])
            self.prefilled += int(n[r])
            if self.cache is not None and n[r] == C:
                self.cache.add(s.request.prompt, s.fed,
                               _take_block(self.state, i, s.fed - C, axes=self.axes, size=C))
            if s.fed == len(s.request.prompt):
                new[i] = int(first[r])
        for i, tok in sorted(new.items()):
            events.append(self._emit(i, tok))
        return events

    def _emit(self, i: int, tok: int) -> Event:
        """Slot i's request gets token `tok`: its event, and its slot freed if it is done."""
        s = self.running[i]
        request = s.request
        finish = None
        if tok == request.stop_token:
            tok, finish = None, "stop"
        else:
            s.out.append(tok)
            self.generated += 1
            if request.stop is not None:
                s.matched = request.stop.step(s.matched, tok)
                finish = "stop" if s.matched < 0 else None
            if finish is None and len(s.out) == request.max_tokens:
                finish = "length"
        if finish is not None:
            self._free(i)
        else:
            self.last[i], self.decoding[i], self.settings[1][i] = s.out[-1], True, len(s.out)
        return Event(s.rid, [] if tok is None else [tok], finish)
