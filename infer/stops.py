"""Stop strings of any length, matched on the generated text, per row, inside the jitted decode loops.

A stop string rarely is one token: "\\n\\n" is two bytes, "Question:" several BPE tokens, and a match may
start or end inside a token. So the strings are matched on bytes, by an Aho-Corasick automaton (a trie of
the strings' UTF-8 bytes with failure links; its states are the strings' prefixes, at most their summed
length + 1), and the automaton is compiled into one dense token-level table:

    table[s, t] = the state after feeding token t's bytes from state s, or -1 if a stop string ends
                  anywhere inside those bytes

A decode loop then carries one state per row (0 at its first generated token: the prompt is not matched)
and does one gather per token: `t = table[state, tok]`, the row is done when t < 0, `state = max(t, 0)`.
The table is built vectorised with numpy: one step per byte position, over every (state, token) pair.
Its states are padded to a power of two, so one compiled loop serves every set of stop strings of
similar length.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


@dataclasses.dataclass(frozen=True, eq=False)
class StopStrings:
    """Stop strings compiled for one vocabulary (`build`): `generate(stop_strings=...)` takes it."""
    strings: tuple[str, ...]
    table: np.ndarray  # (S, V) int16 or int32: the state after a token, -1 where a stop string ends inside it

    def step(self, state: int, token: int) -> int:
        """The matcher's state after `token` from `state` (0 before a row's first generated token); negative once
        a stop string has ended inside that token."""
        return int(self.table[state, token])

    def end(self, ids) -> int:
        """How many of `ids` (a row of generated tokens) to keep: up to the token that completes the first
        stop string, that token included (its bytes may hold text before the match), or all of them."""
        state = 0
        for n, t in enumerate(ids):
            state = self.step(state, t)
            if state < 0:
                return n + 1
        return len(ids)

    def cut(self, text: str) -> str:
        """`text` up to the earliest occurrence of any stop string (as OpenAI's and lm-eval's `stop` do)."""
        return text[:min((i for i in map(text.find, self.strings) if i >= 0), default=len(text))]

    def pending(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string starts with (0: none): text a stream
        holds back until the next tokens show whether a stop string is being written."""
        return max((k for s in self.strings for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)


def build(strings: str | list[str], token_bytes: list[bytes]) -> StopStrings:
    """Compile stop strings (one or a list of non-empty strings) for a vocabulary given as each token id's
    bytes in decoded text (`tokenizer.token_bytes()`, zoo/tokenizer.py; b"" for a token that is never
    text, such as a special token)."""
    strings = checked(strings)
    delta, hit = _automaton([s.encode("utf-8") for s in strings])
    V = len(token_bytes)
    lengths = np.fromiter(map(len, token_bytes), np.int64, V)
    flat = np.frombuffer(b"".join(token_bytes), np.uint8)
    starts = np.cumsum(lengths) - lengths
    state = np.broadcast_to(np.arange(len(hit))[:, None], (len(hit), V)).copy()  # (S, V): from each state
    ended = np.zeros(state.shape, bool)
    for j in range(int(lengths.max(initial=0))):  # byte j of every token that long
        ids = np.flatnonzero(lengths > j)
        nxt = delta[state[:, ids], flat[starts[ids] + j]]
        state[:, ids] = nxt
        ended[:, ids] |= hit[nxt]
    S = 1 << (len(hit) - 1).bit_length()  # padded with rows of 0, never reached
    table = np.pad(np.where(ended, -1, state), ((0, S - len(hit)), (0, 0)))
    return StopStrings(strings, table.astype(np.int16 if S <= np.iinfo(np.int16).max else np.int32))


@functools.lru_cache(maxsize=16)
def for_tokenizer(tok, strings: tuple[str, ...], V: int) -> StopStrings:
    """`strings` compiled for tokenizer `tok` (zoo/tokenizer.py), its ids padded with b"" to the model's V, once
    per (tokenizer, strings): the table reads the whole vocabulary (a second for 151k ids), which callers such as
    the lm-eval backend and the HTTP endpoint would otherwise redo for every batch or request."""
    return build(list(strings), token_bytes(tok, V))


@functools.lru_cache(maxsize=4)
def token_bytes(tok, V: int) -> list[bytes]:
    """`tok.token_bytes()` padded with b"" to V ids (a model's vocabulary may be larger than its tokenizer's):
    each id's bytes in decoded text, read once per tokenizer."""
    return tok.token_bytes() + [b""] * (V - tok.vocab_size)


def checked(strings) -> tuple[str, ...]:
    """Stop strings as a tuple (one string or a list of them), or a ValueError saying what was expected."""
    strings = [strings] if isinstance(strings, str) else strings
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop={strings!r}: expected a non-empty string or a list of them")
    return tuple(strings)


def _automaton(patterns: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes: (delta (S, 256), the next state from each state and byte; hit (S,), whether
    reaching a state ends a pattern, there or at a shorter suffix of it)."""
    children: list[dict[int, int]] = [{}]
    ends = [False]
    for p in patterns:  # the trie: state = a prefix of some pattern
        s = 0
        for b in p:
            if b not in children[s]:
                children[s][b] = len(children)
                children.append({})
                ends.append(False)
            s = children[s][b]
        ends[s] = True
    delta = np.zeros((len(children), 256), np.int64)
    hit = np.asarray(ends)
    fail = [0] * len(children)
    order = [0]
    for s in order:  # breadth first: a state's failure state is shallower, so already filled in
        if s:
            delta[s] = delta[fail[s]]
        for b, c in children[s].items():
            fail[c] = delta[fail[s], b] if s else 0
            hit[c] |= hit[fail[c]]
            delta[s, b] = c
            order.append(c)
    return delta, hit


def advance(table: Int[Array, "S V"] | None, state: Int[Array, " B"] | None, tokens: Int[Array, "B M"],
            done: Bool[Array, " B"], count: Int[Array, " B"] | None = None):
    """Feed each row's tokens (its first count[b] of them; default all) to the automaton from `state` (None:
    the start) under jit: (the new state, done | a stop string ended in them). With no stop strings (table
    None) both come back as they are, so a loop without them compiles as it would without this call."""
    if table is None:
        return state, done
    state = jnp.zeros(tokens.shape[:1], jnp.int32) if state is None else state
    for j in range(tokens.shape[1]):
        fed = True if count is None else j < count
        nxt = table[state, tokens[:, j]].astype(jnp.int32)
        done = done | (fed & (nxt < 0))
        state = jnp.where(fed, jnp.maximum(nxt, 0), state)
    return state, done
