"""The config dataclass of every synthetic task (`data.task`), picked by `kind`; the generators
are train/tasks.py's. A task's sequence length is the run's `train.seq_len`, so a sweep varies it
like any other run; `check` refuses a length or vocabulary the task cannot be built with, naming
the key, when the config loads.

Every task has a training set of `num_train_examples` (null: a fresh example for every row of every
step) and a held-out test set of `num_test_examples`, both drawn from `seed`; accuracy on the test
set is reported as `val_accuracy` in metrics.jsonl.
"""

from dataclasses import dataclass
from typing import ClassVar

from layers.options import NonNegInt, PosFloat, PosInt, UnitFloat

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
