"""Batches from a tokenised corpus: windows read from its memory-mapped shards (train/prepare.py).

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it would have
seen. A split's stream is its shards one after another, read window by window (os.pread, NpyFile), so
a run's memory does not grow with the corpus; a host of a multi-process run reads only its rows
(zoo.sharding.batch_placer says which).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoo import tokenizer

EOD = tokenizer.END_OF_DOCUMENT


def cache_dir() -> Path:
    """$ZOO_CACHE, default ~/.cache/zoo: tokenised corpora and compiled programs."""
    return Path(os.environ.get("ZOO_CACHE", Path.home() / ".cache" / "zoo"))


class NpyFile:
    """A 1-D .npy file read by slices with os.pread. Not a np.memmap: a mapping keeps every page a run
    touched mapped, counted in its resident memory until it ends (on a 2 GB corpus, 20 steps of the
    default run took it from 740 to 1,120 MB); a read leaves nothing behind."""

    def __init__(self, path):
        self.path = str(path)
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            (self.length,), _, self.dtype = read(f)
            self.offset = f.tell()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(self.length)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, max(hi - lo, 0) * self.dtype.itemsize, self.offset + lo * self.dtype.itemsize)
        finally:
            os.close(fd)
        return np.frombuffer(data, self.dtype)


class Stream:
    """One split's tokens: the concatenation of its shards (NpyFiles, or in-memory 1-D arrays)."""

    def __init__(self, shards: list[np.ndarray | NpyFile]):
        self.shards = [s for s in shards if len(s)]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])  # where each shard starts

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def tokens(self) -> np.ndarray:
        """The whole split in memory (for tests and small corpora)."""
        return np.concatenate([s[:] for s in self.shards]) if self.shards else np.zeros(0, np.uint8)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int32: the tokens from each start; a window may span shards."""
        out = np.empty((len(starts), length), np.int32)
        for row, start in enumerate(starts):
            i, filled = int(np.searchsorted(self.offsets, start, side="right")) - 1, 0
            while filled < length:
                lo = int(start) + filled - int(self.offsets[i])
                piece = self.shards[i][lo: lo + length - filled]
                out[row, filled: filled + len(piece)] = piece
                filled, i = filled + len(piece), i + 1
        return out


def segment_ids(x: np.ndarray, eod: int = EOD) -> np.ndarray:
    """Document number of each token inside its window; the end token belongs to the document it ends."""
    ends = (x == eod).astype(np.int32)
    return np.cumsum(ends, axis=-1) - ends


@dataclass
class Batches:
    """Windows of `seq_len + 1` tokens drawn as a pure function of (seed, step)."""
    train: Stream
    val: Stream
    seq_len: int
    seed: int
    packing: bool
    eod: int = EOD

    def __post_init__(self):
        for name, s in (("train", self.train), ("validation", self.val)):
            if len(s) <= self.seq_len + 1:
                raise ValueError(f"train.seq_len: {self.seq_len} does not fit the {name} split of data.corpus "
                                 f"({len(s)} tokens; a window needs seq_len + 2 = {self.seq_len + 2})")

    def _windows(self, stream, rng, n, rows):
        starts = rng.integers(0, len(stream) - self.seq_len - 1, size=n)
        if rows is not None:  # draw all n starts, keep these rows: the same batch on any number of hosts
            starts = starts[rows]
        w = stream.windows(starts, self.seq_len + 1)
        x, y = w[:, :-1], w[:, 1:]
        batch = {"x": x, "y": y, "mask": np.ones(x.shape, np.float32)}
        if self.packing:  # the end token's target is the next document's first token: not learnable alone
            batch["segment_ids"] = segment_ids(x, self.eod)
            batch["mask"] = (x != self.eod).astype(np.float32)
        return batch

    def train_batch(self, step: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        """The batch of `step`; `rows` (indices into it) reads only those rows: one host's share."""
        return self._windows(self.train, np.random.default_rng([self.seed, 0, step]), batch_size, rows)

    def val_batch(self, i: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        """The i-th validation batch: the same windows at every evaluation."""
        return self._windows(self.val, np.random.default_rng([self.seed, 1, i]), batch_size, rows)

