"""Synthetic tasks as data sources of the training loop (`data.task`, configs in zoo/tasks.py).

Each generator makes one example of length L from its own random generator: x (the tokens the model
reads), y (y[t] is the answer expected after reading x[t]) and mask (1 where y is scored). Example
i of a split is drawn from `np.random.default_rng([seed, split, i])`, so a dataset is a pure
function of (seed, index) and a resumed run sees exactly the batches it would have seen. Training
examples never equal a test example: one that does is drawn again (`_rejecting`), so held-out
accuracy is held out even for MAD's 16-token vocabularies.

Departures from the published generators, all in how randomness is drawn, none in the distribution:
- Zoology draws one dataset from one global seed; here every example has its own generator.
- MAD's selective copying draws its blank positions from numpy's global generator; here from the
  example's own.
- MAD shuffles every permutation of the motif vocabulary and picks one; here one is picked uniformly
  (the same distribution, without building and shuffling the list per example).
- MAD's multi-query recall examples are one token shorter than seq_len (seq_len - 1 inputs); here the
  last position is padding that is never scored (causal: it changes nothing before it).
- MAD's fuzzy recall can place its probe pair past the last pair it adds, and then asks a key that
  was never shown; here the probe goes in before the last pair that surely fits.
MAD's compression reconstructs its input through MAD's encoder-decoder, which here is the model
with `model.head: pooled_decoder` (zoo/model.py).
"""

import hashlib
import itertools
import json
import math
import os
from functools import cache

import numpy as np

from train.data import cache_dir
from zoo import tasks as T
from zoo.schema import to_dict

SPLITS = {"train": 0, "test": 1}


def mqar(c: T.MQARConfig, rng, L: int, training: bool):
    """Zoology's multiquery_ar: pairs k1 v1 k2 v2 ... first, then key i again at position 2P + 2 g_i,
    g_i drawn without replacement from p(g) ~ a (g + 1)^(a - 1) over (L - 2P) / 2 gaps; the value
    is the answer at the query; every other position is a random token of [0, V)."""
    V, P = c.vocab_size, c.num_kv_pairs
    keys = rng.choice(np.arange(1, V // 2), P, replace=False)
    values = rng.choice(np.arange(V // 2, V), P, replace=False)
    space = (L - 2 * P) // 2
    p = c.power_a * np.arange(1, space + 1) ** (c.power_a - 1)
    gaps = rng.choice(space, P, replace=False, p=p / p.sum())
    x = rng.integers(0, V, L)  # Zoology: the unset (zero) positions become random tokens of [0, V)
    x[0:2 * P:2], x[1:2 * P:2] = keys, values
    queries = 2 * P + 2 * gaps
    x[queries] = keys
    y, mask = np.zeros(L, np.int64), np.zeros(L, np.int64)
    y[queries], mask[queries] = values, 1
    return x, y, mask


def selective_copying(c: T.SelectiveCopyingConfig, rng, L: int, training: bool):
    """N data tokens of [0, V - 2) with L - 2N - 1 blanks (V - 2) inserted among them (before a data
    token, as MAD), the copy token (V - 1), then N blanks at which the data tokens are the answers."""
    V, N = c.vocab_size, c.num_tokens_to_copy
    blank, copy = V - 2, V - 1
    data = rng.integers(0, V - 2, N)
    head = np.insert(data, rng.integers(0, N, L - 2 * N - 1), blank)
    x = np.concatenate([head, [copy], np.full(N, blank)])
    y, mask = np.zeros(L, np.int64), np.zeros(L, np.int64)
    y[L - N:], mask[L - N:] = data, 1
    return x, y, mask


def induction_heads(c: T.InductionHeadsConfig, rng, L: int, training: bool):
    """Random tokens of [0, V - 1); the special token V - 1 at one position p < L - 2 and again at
    the end; the answer after the last token is the token that followed it at p."""
    special = c.vocab_size - 1
    x = rng.integers(0, special, L)
    p = rng.integers(0, L - 2)
    x[p], x[L - 1] = special, special
    y, mask = np.zeros(L, np.int64), np.zeros(L, np.int64)
    y[L - 1], mask[L - 1] = x[p + 1], 1
    return x, y, mask


def _shifted(tokens: list, scored: list, L: int, training: bool):
    """MAD's autoregressive shift: x = tokens[:-1]; training scores every next token (MAD trains on
    all of them), testing only the `scored` ones (their positions hold the answer, else None).
    Padded on the right to L, never scored."""
    tokens, n = np.asarray(tokens), len(tokens) - 1
    x, y, mask = np.zeros(L, np.int64), np.zeros(L, np.int64), np.zeros(L, np.int64)
    x[:n], y[:n] = tokens[:-1], tokens[1:]
    mask[:n] = 1 if training else [s is not None for s in scored[1:]]
    return x, y, mask


def in_context_recall(c: T.InContextRecallConfig, rng, L: int, training: bool):
    """MAD's in-context recall: L/2 - 1 key-value pairs (or, with probability frac_noise, two noise
    tokens), a key keeping its value when it recurs; with multi_query a recurring key's value is
    scored; then one presented key and its value (after a copy token V - 1 without multi_query)."""
    V, mq = c.vocab_size, c.multi_query
    n = V - (0 if mq else 1) - c.noise_vocab_size
    keys, values, noise = np.arange(n // 2), np.arange(n // 2, n), np.arange(n, n + c.noise_vocab_size)
    pairs = L // 2
    keep = rng.integers(pairs - 1)  # one pair that is never noise (MAD: so a key can be probed)
    tokens, scored, kv = [], [], {}
    for i in range(pairs - 1):
        if c.frac_noise > 0 and i != keep and rng.random() < c.frac_noise:
            tokens += list(rng.choice(noise, 2))
            scored += [None, None]
            continue
        k = int(rng.choice(keys))
        seen = k in kv
        if not seen:
            kv[k] = int(rng.choice(values))
        tokens += [k, kv[k]]
        scored += [None, kv[k] if seen and mq else None]
    probe = int(rng.choice(list(kv)))
    if not mq:
        tokens, scored = tokens + [V - 1], scored + [None]
    tokens, scored = tokens + [probe, kv[probe]], scored + [None, kv[probe]]
    return _shifted(tokens, scored, L, training)


@cache
def _motifs(lo: int, hi: int, size: int) -> np.ndarray:
    """Every ordered tuple of `size` distinct tokens of [lo, hi), one per row."""
    return np.array(list(itertools.permutations(range(lo, hi), size)), np.int64).reshape(-1, size)


def fuzzy_recall(c: T.FuzzyRecallConfig, rng, L: int, training: bool):
    """MAD's fuzzy in-context recall: keys and values are motifs of 1..k_motif_size (1..v_motif_size)
    distinct adjacent tokens (test keys always k_motif_size); one probe pair is placed at a random
    point of the sequence and asked again at the end; left-padded to L + 1 tokens, then shifted."""
    V, mq, K, Vm = c.vocab_size, c.multi_query, c.k_motif_size, c.v_motif_size
    pad = V - 1 if mq else V - 2
    n = V - 1 if mq else V - 2
    key_sizes = list(range(1, K + 1)) if training else [K]
    pick = lambda lo, hi, size: tuple(int(t) for t in rng.choice(_motifs(lo, hi, size)))
    key = lambda size: pick(0, n // 2, size)
    value = lambda size: pick(n // 2, n, size)
    pk, pv = int(rng.choice(key_sizes)), int(rng.integers(1, Vm + 1))
    k_probe, v_probe = key(pk), value(pv)
    probe_at = rng.integers(L - 2 * (pk + pv))
    tokens, scored, kv, added = [], [], {}, False
    end = L - (pk + pv) - (K + Vm)
    while len(tokens) < end:
        ks, vs = int(rng.choice(key_sizes)), int(rng.integers(1, Vm + 1))
        if len(tokens) >= min(probe_at, end - K - Vm) and not added:  # MAD's may fall past the end
            tokens += [*k_probe, *v_probe]
            scored += [None] * (pk + pv)
            kv[k_probe], added = v_probe, True
            continue
        k = key(ks)
        seen = k in kv
        if k == k_probe:
            kv[k], added = v_probe, True
        elif not seen:
            kv[k] = value(vs)
        tokens += [*k, *kv[k]]
        scored += [None] * ks + (list(kv[k]) if seen and mq else [None] * len(kv[k]))
    if not mq:
        tokens, scored = tokens + [V - 1], scored + [None]
    tokens, scored = tokens + [*k_probe, *v_probe], scored + [None] * pk + list(v_probe)
    lead = L + 1 - len(tokens)
    return _shifted([pad] * lead + tokens, [None] * lead + scored, L, training)


def memorization(c: T.MemorizationConfig, rng, L: int, training: bool):
    """MAD's memorization: L/2 keys, each followed by the insert token V - 1, at which its value in
    a fixed map (keys [0, (V-1)/2) paired with shuffled values [(V-1)/2, V-1), from map_seed) is the
    answer."""
    keys, values = _memory(c.vocab_size, c.map_seed)
    chosen = rng.integers(0, len(keys), L // 2)
    x, y, mask = np.zeros(L, np.int64), np.zeros(L, np.int64), np.zeros(L, np.int64)
    x[0::2], x[1::2] = keys[chosen], c.vocab_size - 1
    y[1::2], mask[1::2] = values[chosen], 1
    return x, y, mask


def compression(c: T.CompressionConfig, rng, L: int, training: bool):
    """MAD's compression: L - 1 random tokens of [0, V - 1), then the compression token V - 1; every
    position (the compression token too, as MAD) is to be reconstructed: y = x."""
    x = np.append(rng.integers(0, c.vocab_size - 1, L - 1), c.vocab_size - 1)
    return x, x.copy(), np.ones(L, np.int64)


@cache
def _memory(V: int, seed: int):
    rng = np.random.default_rng(seed)
    n = V - 1
    keys, values = rng.permutation(n // 2), rng.permutation(np.arange(n // 2, n))
    m = min(len(keys), len(values))
    return keys[:m], values[:m]


NEEDLE, QUERY = 0, 1  # the needle and query markers of the retrieval tasks; the digits 0-9 are tokens 2-11


def _words(c: T.NeedleTask, rng) -> list[int]:
    """The word tokens [12, 12 + words) in a random order: keys and variables are taken from the front."""
    return [int(w) for w in rng.permutation(np.arange(12, 12 + c.words()))]


def _values(c: T.NeedleTask, rng, n: int, words: list[int]) -> list[list[int]]:
    """n distinct values of value_len tokens: digits (passkey) or tokens of `words` (word)."""
    pool, out = np.arange(2, 12) if c.value == "passkey" else np.asarray(words), []
    while len(out) < n:  # check() makes sure n distinct values exist
        v = [int(t) for t in rng.choice(pool, c.value_len)]
        if v not in out:
            out.append(v)
    return out


def _haystack(c: T.NeedleTask, rng, L: int, chains: list, asks: list):
    """Chains of needles (token lists) in a haystack of F filler tokens (F: what the needles and asks
    leave of L + 1): the first chain's first needle after round(depth * F) of them, its later needles
    in order after it, other chains' needles in order anywhere; then the asks, (query, answer) token
    lists, each answer token scored (after the token before it, as a next-token target)."""
    tail = [t for q, a in asks for t in q + a]
    F = L + 1 - len(tail) - sum(len(n) for chain in chains for n in chain)
    first = round((rng.random() if c.depth is None else c.depth) * F)
    at = []
    for g, chain in enumerate(chains):
        offsets = np.sort(rng.integers(first if g == 0 else 0, F + 1, len(chain)))
        if g == 0:
            offsets[0] = first
        at += [(int(o), g, j) for j, o in enumerate(offsets)]
    filler = rng.integers(12 + c.words(), c.vocab_size, F)
    tokens, done = [], 0
    for o, g, j in sorted(at):  # ties: the asked chain first, so exactly `first` filler tokens precede it
        tokens += [*filler[done:o], *chains[g][j]]
        done = o
    tokens += list(filler[done:])
    scored = [None] * len(tokens)
    for q, a in asks:
        tokens, scored = tokens + q + a, scored + [None] * len(q) + a
    return _shifted(tokens, scored, L, training=False)


def needle(c: T.NeedleConfig, rng, L: int, training: bool):
    """RULER's single needle: `NEEDLE key value` in the haystack, `QUERY key` at the end, the value scored."""
    key, *rest = _words(c, rng)
    value = _values(c, rng, 1, rest)[0]
    return _haystack(c, rng, L, [[[NEEDLE, key, *value]]], [([QUERY, key], value)])


def needle_multikey(c: T.NeedleMultiKeyConfig, rng, L: int, training: bool):
    """The single needle among num_distractors needles of other keys and values."""
    words, n = _words(c, rng), 1 + c.num_distractors
    keys, values = words[:n], _values(c, rng, n, words[n:])
    return _haystack(c, rng, L, [[[NEEDLE, k, *v]] for k, v in zip(keys, values)], [([QUERY, keys[0]], values[0])])


def needle_multivalue(c: T.NeedleMultiValueConfig, rng, L: int, training: bool):
    """num_values needles of one key, in order; the key asked, its values scored in that order."""
    key, *rest = _words(c, rng)
    values = _values(c, rng, c.num_values, rest)
    return _haystack(c, rng, L, [[[NEEDLE, key, *v] for v in values]], [([QUERY, key], sum(values, []))])


def needle_multiquery(c: T.NeedleMultiQueryConfig, rng, L: int, training: bool):
    """num_queries needles of distinct keys, every key asked and each value scored: first the key of the
    needle at the depth, then the others' (at random places, so in no order of place)."""
    words, n = _words(c, rng), c.num_queries
    keys, values = words[:n], _values(c, rng, n, words[n:])
    return _haystack(c, rng, L, [[[NEEDLE, k, *v]] for k, v in zip(keys, values)],
                     [([QUERY, k], v) for k, v in zip(keys, values)])


def variable_tracking(c: T.VariableTrackingConfig, rng, L: int, training: bool):
    """RULER's variable tracking: chains `NEEDLE X1 value`, `NEEDLE X2 X1`, ..., `NEEDLE X(h+1) Xh`;
    `QUERY value` of the first chain asked, its variables X1..X(h+1) scored in order."""
    words, h = _words(c, rng), c.num_hops
    n = c.num_chains * (h + 1)
    names = [words[i:i + h + 1] for i in range(0, n, h + 1)]
    values = _values(c, rng, c.num_chains, words[n:])
    chains = [[[NEEDLE, x[0], *v]] + [[NEEDLE, x[i + 1], x[i]] for i in range(h)] for x, v in zip(names, values)]
    return _haystack(c, rng, L, chains, [([QUERY, *values[0]], names[0])])


GENERATORS = {T.MQARConfig: mqar, T.SelectiveCopyingConfig: selective_copying,
              T.InductionHeadsConfig: induction_heads, T.InContextRecallConfig: in_context_recall,
              T.NoisyRecallConfig: in_context_recall, T.FuzzyRecallConfig: fuzzy_recall,
              T.MemorizationConfig: memorization, T.CompressionConfig: compression, T.NeedleConfig: needle,
              T.NeedleMultiKeyConfig: needle_multikey, T.NeedleMultiValueConfig: needle_multivalue,
              T.NeedleMultiQueryConfig: needle_multiquery, T.VariableTrackingConfig: variable_tracking}


def example(cfg: T.Task, split: str, i: int, L: int, attempt: int = 0):
    """(x, y, mask) of example i of `split`, a pure function of (cfg, split, i, L); `attempt` > 0
    draws it again (from `[seed, split, i, attempt]`)."""
    rng = np.random.default_rng([cfg.seed, SPLITS[split], i] + ([attempt] if attempt else []))
    return GENERATORS[type(cfg)](cfg, rng, L, split == "train")


def _rejecting(cfg, i: int, L: int, test: set):
    """Training example i, drawn again (attempt 1, 2, ...) while its tokens equal a test example's."""
    for attempt in itertools.count():
        x, y, mask = example(cfg, "train", i, L, attempt)
        if x.tobytes() not in test:
            return x, y, mask


def _stack(rows):
    x, y, mask = (np.stack(a) for a in zip(*rows))
    return {"x": x.astype(np.int32), "y": y.astype(np.int32), "mask": mask.astype(np.float32)}


class TaskBatches:
    """Batches of a task with the interface of train.data.Batches: train_batch(step, B, rows) draws
    B training examples as a function of (seed, step); val_batch(i, B, rows) is the i-th slice of
    the test set (the last padded with unscored rows), num_val_batches(B) of them cover it. The sets
    are made once per (task, seq_len) and kept as .npz files under $ZOO_CACHE."""

    def __init__(self, cfg: T.Task, seq_len: int, seed: int):
        self.cfg, self.L, self.seed = cfg, seq_len, seed
        self.test = self._load("test", lambda: _stack([example(cfg, "test", i, seq_len)
                                                       for i in range(cfg.num_test_examples)]))
        self._seen = {row.tobytes() for row in self.test["x"].astype(np.int64)}
        self.train = None if cfg.num_train_examples is None else self._load(
            "train", lambda: _stack([_rejecting(cfg, i, seq_len, self._seen) for i in range(cfg.num_train_examples)]))

    def _load(self, split: str, make) -> dict:
        key = hashlib.sha256(json.dumps([to_dict(self.cfg), self.cfg.KIND, self.L, "tasks-v1"]).encode()).hexdigest()
        path = cache_dir() / f"task-{key[:16]}" / f"{split}.npz"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{split}.{os.getpid()}.tmp.npz")  # write then rename: never a torn file
            np.savez(tmp, **make())
            tmp.replace(path)
        with np.load(path) as f:
            return {k: f[k] for k in f.files}

    def train_batch(self, step: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        rows = np.arange(batch_size) if rows is None else rows
        if self.train is None:  # a fresh example per (step, row)
            return _stack([_rejecting(self.cfg, step * batch_size + int(r), self.L, self._seen) for r in rows])
        idx = np.random.default_rng([self.seed, 0, step]).integers(0, self.cfg.num_train_examples, batch_size)[rows]
        return {k: v[idx] for k, v in self.train.items()}

    def num_val_batches(self, batch_size: int) -> int:
        return math.ceil(self.cfg.num_test_examples / batch_size)

    def val_batch(self, i: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        idx = i * batch_size + (np.arange(batch_size) if rows is None else rows)
        n = self.cfg.num_test_examples
        batch = {k: v[idx % n] for k, v in self.test.items()}
        batch["mask"] = batch["mask"] * (idx < n)[:, None]
        return batch
