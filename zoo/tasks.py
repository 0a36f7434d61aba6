"""The config dataclass of every synthetic task (`data.task`), picked by `kind`; the generators
are train/tasks.py's. A task's sequence length is the run's `train.seq_len`, so a sweep varies it
like any other run; `check` refuses a length or vocabulary the task cannot be built with, naming
the key, when the config loads.

Every task has a training set of `num_train_examples` (null: a fresh example for every row of every
step) and a held-out test set of `num_test_examples`, both drawn from `seed`; accuracy on the test
set is reported as `val_accuracy` in metrics.jsonl.
"""

from dataclasses import dataclass
from typing import Annotated, ClassVar

from layers.options import NonNegInt, OneOf, PosFloat, PosInt, UnitFloat

TASKS: dict[str, type] = {}  # kind -> config dataclass


def task(cls):
    """Class decorator: register a task config dataclass under its KIND."""
    if cls.KIND in TASKS:
        raise ValueError(f"task {cls.KIND!r} is registered twice")
    TASKS[cls.KIND] = cls
    return cls


@dataclass(frozen=True)
class Task:
    KIND: ClassVar[str]
    vocab_size: PosInt = 16
    num_train_examples: PosInt | None = 12_800
    num_test_examples: PosInt = 1_280
    seed: NonNegInt = 0

    def check(self, seq_len: int, path: str):
        """Raise a ValueError naming the key when this task cannot be built at `seq_len`."""

    def _need(self, ok: bool, key: str, path: str, what: str):
        if not ok:
            raise ValueError(f"{path}.{key}: {what}")


@task
@dataclass(frozen=True)
class MQARConfig(Task):
    """Multi-query associative recall as Zoology (Arora et al. 2023): num_kv_pairs key-value pairs
    (keys from [1, V/2), values from [V/2, V), without replacement), then each key queried once at a
    gap drawn from p(i) ~ a * i^(a-1) (power_a), the rest random tokens; scored at the queries."""
    KIND: ClassVar[str] = "mqar"
    vocab_size: PosInt = 8192
    num_kv_pairs: PosInt = 8
    power_a: PosFloat = 0.01
    num_train_examples: PosInt | None = 100_000
    num_test_examples: PosInt = 3_000

    def check(self, seq_len: int, path: str):
        self._need(seq_len % 2 == 0, "kind", path, f"mqar needs an even train.seq_len, got {seq_len}")
        self._need(4 * self.num_kv_pairs <= seq_len, "num_kv_pairs", path,
                   f"{self.num_kv_pairs} pairs need train.seq_len >= {4 * self.num_kv_pairs} (4 per pair), "
                   f"got {seq_len}")
        self._need(self.vocab_size > seq_len, "vocab_size", path,
                   f"mqar needs vocab_size > train.seq_len ({seq_len}), got {self.vocab_size}")
        self._need(self.num_kv_pairs < self.vocab_size // 2, "num_kv_pairs", path,
                   f"{self.num_kv_pairs} distinct keys do not fit in [1, vocab_size/2 = {self.vocab_size // 2})")


@task
@dataclass(frozen=True)
class SelectiveCopyingConfig(Task):
    """Selective copying (Gu & Dao 2023, section 4.1; MAD's baseline: vocab 16, length 256, 16 tokens;
    the Mamba paper's is length 4096): num_tokens_to_copy data tokens scattered among blanks, a copy
    token, then as many blanks, at which the data tokens are to be output in order."""
    KIND: ClassVar[str] = "selective_copying"
    num_tokens_to_copy: PosInt = 16

    def check(self, seq_len: int, path: str):
        self._need(seq_len > 2 * self.num_tokens_to_copy + 1, "num_tokens_to_copy", path,
                   f"{self.num_tokens_to_copy} tokens need train.seq_len > {2 * self.num_tokens_to_copy + 1}, "
                   f"got {seq_len}")
        self._need(self.vocab_size >= 3, "vocab_size", path,
                   f"expected >= 3 (blank, copy, a token), got {self.vocab_size}")


@task
@dataclass(frozen=True)
class InductionHeadsConfig(Task):
    """Induction heads (Olsson et al. 2022; Gu & Dao 2023, section 4.1: vocab 16, length 256): random
    tokens, a special token once followed by the answer, and the special token again at the end,
    after which the answer is to be output."""
    KIND: ClassVar[str] = "induction_heads"

    def check(self, seq_len: int, path: str):
        self._need(seq_len >= 4, "kind", path, f"induction_heads needs train.seq_len >= 4, got {seq_len}")
        self._need(self.vocab_size >= 3, "vocab_size", path, f"expected >= 3, got {self.vocab_size}")


@task
@dataclass(frozen=True)
class InContextRecallConfig(Task):
    """MAD's in-context recall (Poli et al. 2024; baseline: vocab 16, length 128, multi_query):
    key-value pairs, keys reused; with multi_query every repeated key's value is scored, without it
    one key is probed after a copy token at the end. noise_vocab_size / frac_noise add noise pairs
    (MAD's noisy recall)."""
    KIND: ClassVar[str] = "in_context_recall"
    multi_query: bool = True
    noise_vocab_size: NonNegInt = 0
    frac_noise: UnitFloat = 0.0

    def check(self, seq_len: int, path: str):
        self._need(seq_len % 2 == 0 and seq_len >= 4, "kind", path,
                   f"{self.KIND} needs an even train.seq_len >= 4, got {seq_len}")
        special = 0 if self.multi_query else 1
        self._need(self.vocab_size - special - self.noise_vocab_size >= 2, "vocab_size", path,
                   f"{self.vocab_size} leaves no keys and values beside {self.noise_vocab_size} noise tokens")
        self._need(self.frac_noise < 1 and (self.frac_noise == 0 or self.noise_vocab_size > 0), "frac_noise", path,
                   f"expected 0 <= frac_noise < 1, and noise_vocab_size > 0 when it is not 0; got {self.frac_noise}")


@task
@dataclass(frozen=True)
class NoisyRecallConfig(InContextRecallConfig):
    """MAD's noisy in-context recall: in_context_recall with noise pairs (baseline: vocab 32 of
    which 16 are noise tokens, frac_noise 0.2, length 128)."""
    KIND: ClassVar[str] = "noisy_recall"
    vocab_size: PosInt = 32
    noise_vocab_size: NonNegInt = 16
    frac_noise: UnitFloat = 0.2


@task
@dataclass(frozen=True)
class FuzzyRecallConfig(Task):
    """MAD's fuzzy in-context recall (baseline: vocab 16, length 128, keys and values of 1 to 3
    adjacent tokens, multi_query); test keys are always k_motif_size tokens long."""
    KIND: ClassVar[str] = "fuzzy_recall"
    k_motif_size: PosInt = 3
    v_motif_size: PosInt = 3
    multi_query: bool = True

    def check(self, seq_len: int, path: str):
        self._need(seq_len > 3 * (self.k_motif_size + self.v_motif_size), "k_motif_size", path,
                   f"motifs of {self.k_motif_size} + {self.v_motif_size} tokens need train.seq_len > "
                   f"{3 * (self.k_motif_size + self.v_motif_size)}, got {seq_len}")
        keys = (self.vocab_size - (1 if self.multi_query else 2)) // 2
        self._need(keys >= self.k_motif_size and keys >= 1, "vocab_size", path,
                   f"{self.vocab_size} leaves {keys} key tokens, fewer than k_motif_size={self.k_motif_size}")


@task
@dataclass(frozen=True)
class MemorizationConfig(Task):
    """MAD's memorization (baseline: vocab 256, length 32, 256 training examples): keys each followed
    by an insert token, at which the value of a fixed key-value map (drawn from map_seed) is to be
    output; the map is never shown, so it must be learned into the weights."""
    KIND: ClassVar[str] = "memorization"
    vocab_size: PosInt = 256
    num_train_examples: PosInt | None = 256
    map_seed: NonNegInt = 12345

    def check(self, seq_len: int, path: str):
        self._need(seq_len % 2 == 0, "kind", path, f"memorization needs an even train.seq_len, got {seq_len}")
        self._need(self.vocab_size >= 5, "vocab_size", path, f"expected >= 5, got {self.vocab_size}")


@task
@dataclass(frozen=True)
class CompressionConfig(Task):
    """MAD's compression (baseline: vocab 16, length 32): L - 1 random tokens and a compression token
    (V - 1); every position is to be reconstructed from the last position's state alone, so it
    needs model.head: pooled_decoder (MAD's encoder-decoder)."""
    KIND: ClassVar[str] = "compression"

    def check(self, seq_len: int, path: str):
        self._need(seq_len >= 2 and self.vocab_size >= 2, "vocab_size", path,
                   f"compression needs train.seq_len >= 2 and vocab_size >= 2, got {seq_len} and {self.vocab_size}")


@dataclass(frozen=True)
class NeedleTask(Task):
    """RULER-style retrieval (Hsieh et al. 2024), token-level: a haystack of filler tokens holds
    needles `NEEDLE key value...`; the first needle's key is asked at the end (`QUERY key`) and the
    answer tokens after it are scored. value: passkey (value_len digits) or word (value_len word
    tokens); depth: the fraction of the filler before the asked needle (null: uniform per example).
    Vocabulary: 0 NEEDLE, 1 QUERY, 2-11 the digits, then words (keys, word values, variables) and
    filler, half each of the rest. train/tasks.py draws the examples; docs/experiments.md lists the
    departures from RULER."""
    vocab_size: PosInt = 64
    num_train_examples: PosInt | None = None
    num_test_examples: PosInt = 512
    value: Annotated[str, OneOf("passkey", "word")] = "passkey"
    value_len: PosInt = 4
    depth: UnitFloat | None = None

    def words(self) -> int:
        return (self.vocab_size - 12) // 2

    def sizes(self) -> tuple[int, int, int]:
        """(tokens of the needles, tokens of the queries and answers, distinct words) of one example."""
        return 2 + self.value_len, 2 + self.value_len, 1

    def values(self) -> int:
        """How many distinct values an example can draw from."""
        return (10 if self.value == "passkey" else self.words()) ** self.value_len

    def check(self, seq_len: int, path: str):
        needles, asks, words = self.sizes()
        words += self.value == "word"  # keys and variables, and a word to draw values from
        self._need(self.words() >= words, "vocab_size", path,
                   f"{self.KIND} needs {words} words (and as many filler tokens): vocab_size >= {12 + 2 * words}, "
                   f"got {self.vocab_size}")
        self._need(seq_len + 1 >= needles + asks, "kind", path,
                   f"{self.KIND} needs train.seq_len >= {needles + asks - 1} for its needles and query, got {seq_len}")


@task
@dataclass(frozen=True)
class NeedleConfig(NeedleTask):
    """Single needle (RULER's niah_single): one key and its value in the haystack, the key asked."""
    KIND: ClassVar[str] = "needle"


@task
@dataclass(frozen=True)
class NeedleMultiKeyConfig(NeedleTask):
    """RULER's niah_multikey: num_distractors more needles with other keys (and values); one key asked."""
    KIND: ClassVar[str] = "needle_multikey"
    num_distractors: PosInt = 3

    def sizes(self):
        return (1 + self.num_distractors) * (2 + self.value_len), 2 + self.value_len, 1 + self.num_distractors


@task
@dataclass(frozen=True)
class NeedleMultiValueConfig(NeedleTask):
    """RULER's niah_multivalue: num_values needles with the same key and distinct values (in the order
    they are to be produced, the first at the depth); the key asked, every value scored."""
    KIND: ClassVar[str] = "needle_multivalue"
    num_values: PosInt = 4

    def sizes(self):
        return self.num_values * (2 + self.value_len), 2 + self.num_values * self.value_len, 1

    def check(self, seq_len: int, path: str):
        super().check(seq_len, path)
        self._need(self.values() >= self.num_values, "num_values", path,
                   f"{self.num_values} distinct values do not fit in {self.values()} possible ones")


@task
@dataclass(frozen=True)
class NeedleMultiQueryConfig(NeedleTask):
    """RULER's niah_multiquery: num_queries needles with distinct keys, every key asked (the one at the
    depth first), each followed by its value."""
    KIND: ClassVar[str] = "needle_multiquery"
    num_queries: PosInt = 4

    def sizes(self):
        n = self.num_queries
        return n * (2 + self.value_len), n * (2 + self.value_len), n


@task
@dataclass(frozen=True)
class VariableTrackingConfig(NeedleTask):
    """RULER's variable tracking: num_chains chains of assignments `NEEDLE X1 value`, `NEEDLE X2 X1`,
    ... (num_hops after the first, in order, the first at the depth), with distinct values; the first
    chain's value is asked (`QUERY value`) and its num_hops + 1 variables are the answer, in order."""
    KIND: ClassVar[str] = "variable_tracking"
    num_chains: PosInt = 1
    num_hops: PosInt = 4

    def sizes(self):
        links = self.num_chains * (self.num_hops + 1)
        return self.num_chains * (2 + self.value_len) + self.num_chains * self.num_hops * 3, \
            1 + self.value_len + self.num_hops + 1, links

    def check(self, seq_len: int, path: str):
        super().check(seq_len, path)
        self._need(self.values() >= self.num_chains, "num_chains", path,
                   f"{self.num_chains} distinct values do not fit in {self.values()} possible ones")
