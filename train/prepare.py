"""python -m train.prepare CONFIG [dotted.key=value ...]: tokenise a corpus once into memory-mapped shards.

`python -m train` runs this on demand; run it alone first for a large corpus (or once before a
multi-host run). The corpus (train/corpus.py) is cut into pieces of about `data.shard_mb`, grouped
into units; `data.workers` processes tokenise the units, each writing its shards:

    $ZOO_CACHE/corpus-<key>/
      tokenizer.json        bpe: trained on the training split; file: a copy of data.tokenizer.path
      train-00003.npy       unit 3's training tokens (uint8/16/32), each document followed by the end token
      train-00003.docs.npy  the document index: where each of those documents ends (int64 offsets)
      val-00003.npy, val-00003.docs.npy
      unit-00003.json       unit 3's counts (tokens, bytes, documents, skipped input), written after its shards
      meta.json             written last: every split's shards and counts. A folder without it is unfinished

The key hashes the format, every corpus file's name, size and modification time, the tokenizer
config (and a tokenizer file's bytes), the split rule, packing, text_field, invalid_utf8, the shard
dtype and size: a changed input gets a new folder and can never read a stale one. Every file is
written under a temporary name and renamed, so a SIGKILL leaves only whole files; a rerun keeps the
units whose unit-*.json exists and tokenises the others. Runs on several hosts that share the cache
may prepare at once: their files are identical, and the first trained tokenizer.json wins (os.link).

Bits per byte: each split stores its UTF-8 bytes, counting the end-of-document token as one byte as
the byte tokenizer does, so `loss * tokens / bytes / ln 2` puts every tokenizer on one scale; for the
byte tokenizer tokens == bytes and it is loss / ln 2 exactly.
"""

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.corpus import check_split, corpus_files, documents, is_validation, pieces, split_documents
from train.data import Batches, NpyFile, Stream, cache_dir
from zoo import load_config
from zoo import tokenizer as tokenizers_lib
from zoo.config import DataConfig, to_dict

VERSION = "shards-v1"
SPLITS = ("train", "val")
SPAWN_WORTH = 16 * 2 ** 20  # bytes of input below which one process tokenises alone


@dataclass
class Prepared:
    """A finished cache folder: its splits as Streams, the tokenizer, the end token, bytes per token."""
    folder: Path
    meta: dict

    @property
    def eod(self) -> int:
        return self.meta["eod"]

    def tokenizer(self):
        """zoo.tokenizer.Bytes, or an HFTokenizer whose eos is the end-of-document token."""
        if self.meta["tokenizer"] == "bytes":
            return tokenizers_lib.Bytes
        tok = tokenizers_lib.HFTokenizer(self.folder / "tokenizer.json")
        tok.eos_id = self.eod
        return tok

    def stream(self, split: str) -> Stream:
        shards = []
        for s in self.meta["splits"][split]["shards"]:
            arr = NpyFile(self.folder / s["file"])
            if len(arr) != s["tokens"]:
                raise ValueError(f"{self.folder / s['file']}: {len(arr)} tokens, meta.json says {s['tokens']}; the "
                                 "cache was changed after it was written: delete the folder and prepare again")
            shards.append(arr)
        return Stream(shards)

    def tokens_per_byte(self, split: str = "val") -> float:
        s = self.meta["splits"][split]
        return s["tokens"] / s["bytes"]

    def batches(self, seq_len: int, seed: int, packing: bool) -> Batches:
        return Batches(self.stream("train"), self.stream("val"), seq_len=seq_len, seed=seed, packing=packing,
                       eod=self.eod)


def cache_key(data: DataConfig, files: list[tuple[Path, str]]) -> str:
    rule = data.val_docs if data.val_fraction is None else data.val_fraction
    corpus = data.corpus if data.corpus == "shakespeare" else str(Path(data.corpus).resolve())
    h = hashlib.sha256(repr((VERSION, corpus, rule, data.packing, data.text_field, data.invalid_utf8,
                             data.shard_dtype, data.shard_mb, to_dict(data.tokenizer))).encode())
    for f, name in files:
        try:
            st = f.stat()
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{name}\0unreadable\n".encode())
    if data.tokenizer.kind == "file":
        h.update(Path(data.tokenizer.path).read_bytes())
    return h.hexdigest()[:16]


def prepare(data: DataConfig, log=print) -> Prepared:
    """The corpus of `data` tokenised into shards, from the cache when they are there (a folder
    without meta.json is finished first)."""
    files = corpus_files(data.corpus)
    check_split(files, data)
    folder = cache_dir() / f"corpus-{cache_key(data, files)}"
    if not (folder / "meta.json").is_file():
        _build(folder, data, files, log)
    prepared = Prepared(folder, json.loads((folder / "meta.json").read_text()))
    counts = {s: prepared.meta["splits"][s]["docs"] for s in SPLITS}
    if not all(counts.values()):
        rule = f"data.val_fraction: {data.val_fraction}" if data.val_fraction is not None else \
            f"data.val_docs: {list(data.val_docs)}"
        raise ValueError(f"{rule} leaves {counts['train']} documents to train on and {counts['val']} for validation "
                         f"in {data.corpus!r}; both need at least one")
    return prepared


def _atomic_write(path: Path, write):
    """write(tmp_path), then rename: a reader sees the whole file or none."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp{path.suffix}")
    write(tmp)
    tmp.replace(path)


def _dtype(data: DataConfig) -> str:
    if data.shard_dtype != "auto":
        return data.shard_dtype
    n = tokenizers_lib.vocab_size_of(data.tokenizer)
    return "uint8" if n <= 2 ** 8 else "uint16" if n <= 2 ** 16 else "uint32"


def _units(data: DataConfig, files, skipped: list) -> list[list]:
    """Consecutive pieces grouped into units of about data.shard_mb: one unit, one shard per split. A
    file named in val_docs gets units of its own, so the validation stream can follow val_docs' order."""
    target, held = max(1, int(data.shard_mb * 2 ** 20)), _held(data)
    units, size, last = [], target, None
    for p in pieces(files, target, data, skipped):
        if size >= target or p.name != last and (p.name in held or last in held):
            units.append([])
            size = 0
        units[-1].append(p)
        size, last = size + p.size, p.name
    return units


def _held(data: DataConfig) -> tuple[str, ...]:
    return data.val_docs if data.val_fraction is None else ()


def _unit_documents(unit, data: DataConfig, skipped: list) -> dict[str, list[str]]:
    """split -> the unit's documents in that split, in corpus order, as the stream holds them."""
    texts = {s: [] for s in SPLITS}
    for piece in unit:
        for name, file_name, text in documents(piece, data, skipped):
            texts["val" if is_validation(name, file_name, data) else "train"].append(text)
    return {s: split_documents(t, data.packing) for s, t in texts.items()}


def _tokenizer(folder: Path, data: DataConfig, units, log) -> Path | None:
    """The cache folder's tokenizer.json (trained for bpe, copied for file); None for bytes."""
    cfg, path = data.tokenizer, folder / "tokenizer.json"
    if cfg.kind == "bytes" or path.is_file():
        return None if cfg.kind == "bytes" else path
    if cfg.kind == "file":
        _atomic_write(path, lambda tmp: tmp.write_bytes(Path(cfg.path).read_bytes()))
        return path
    t0 = time.perf_counter()
    log(f"prepare: training a {cfg.vocab_size}-token byte-level BPE on the training split of {data.corpus}")
    texts = (t for unit in units for t in _unit_documents(unit, data, [])["train"])
    tok = tokenizers_lib.train_bpe(texts, cfg)
    tmp = path.with_name(f"tokenizer.{os.getpid()}.tmp.json")
    tok.save(str(tmp))
    try:  # the first tokenizer written wins: hosts preparing at once all tokenise with the same one
        os.link(tmp, path)
    except FileExistsError:
        pass
    tmp.unlink()
    log(f"prepare: BPE trained in {time.perf_counter() - t0:.1f} s ({tok.get_vocab_size()} tokens)")
    return path


_ENCODERS = {}


def _encode(texts: list[str], tok_path: str | None, eod: int, dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, document end offsets, UTF-8 bytes) of documents, each followed by the end token."""
    if tok_path is None:  # bytes: byte 0 ends a document, so a NUL inside one is dropped
        tokens = np.frombuffer("".join(t.replace("\x00", "") + "\x00" for t in texts).encode("utf-8"), np.uint8)
        return tokens.astype(dtype), np.flatnonzero(tokens == 0) + 1, len(tokens)
    if tok_path not in _ENCODERS:
        _ENCODERS[tok_path] = tokenizers_lib.document_encoder(tok_path)
    encoder, parts = _ENCODERS[tok_path], []
    for i in range(0, len(texts), 256):  # in batches: the library's encodings hold ~100 bytes a token
        parts += [e.ids + [eod] for e in encoder.encode_batch_fast(texts[i: i + 256], add_special_tokens=False)]
    ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
    tokens = np.fromiter((i for p in parts for i in p), dtype, count=int(ends[-1]) if len(ends) else 0)
    return tokens, ends, sum(len(t.encode("utf-8")) + 1 for t in texts)


def _tokenise_unit(job) -> dict:
    """Worker: tokenise unit i, write its shards, then its unit-<i>.json; returns the counts."""
    folder, i, unit, data, tok_path, eod, dtype = job
    skipped, out = [], {"input_bytes": sum(p.size for p in unit)}
    for split, texts in _unit_documents(unit, data, skipped).items():
        tokens, ends, nbytes = _encode(texts, tok_path, eod, dtype)
        name = f"{split}-{i:05d}"
        _atomic_write(folder / f"{name}.docs.npy", lambda tmp: np.save(tmp, ends))
        _atomic_write(folder / f"{name}.npy", lambda tmp: np.save(tmp, tokens))
        out[split] = {"file": f"{name}.npy", "tokens": len(tokens), "bytes": nbytes, "docs": len(ends)}
    out["skipped"] = skipped
    _atomic_write(folder / f"unit-{i:05d}.json", lambda tmp: tmp.write_text(json.dumps(out)))
    if os.environ.get("ZOO_PREPARE_SLEEP"):  # tests: a pause between shards to kill the process in
        time.sleep(float(os.environ["ZOO_PREPARE_SLEEP"]))
    return out


def _quiet_worker():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism


def _build(folder: Path, data: DataConfig, files, log):
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    skipped = []
    units = _units(data, files, skipped)
    tok_path = _tokenizer(folder, data, units, log)
    eod = tokenizers_lib.END_OF_DOCUMENT if tok_path is None else \
        tokenizers_lib.HFTokenizer(tok_path).tokenizer.token_to_id(data.tokenizer.end_of_document)
    todo = [i for i in range(len(units)) if not (folder / f"unit-{i:05d}.json").is_file()]
    jobs = [(folder, i, units[i], data, None if tok_path is None else str(tok_path), eod, _dtype(data)) for i in todo]
    total = sum(p.size for i in todo for p in units[i])
    workers = min(data.workers or os.cpu_count() or 1, len(jobs))
    if total < SPAWN_WORTH:  # starting a process (it imports jax) costs seconds: not for a small corpus
        workers = 1
    log(f"prepare: tokenising {total / 2 ** 20:,.1f} MB of {data.corpus} in {len(jobs)} shards with {workers} "
        f"processes into {folder}" + (f" ({len(units) - len(todo)} shards already there)" if len(todo) < len(units)
                                      else ""))
    t1 = time.perf_counter()
    with _progress(total) as advance:
        if workers <= 1:
            for job in jobs:
                advance(_tokenise_unit(job)["input_bytes"])
        else:
            spawn = multiprocessing.get_context("spawn")  # not fork: the parent may run jax's threads
            try:
                with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_quiet_worker) as pool:
                    for out in pool.map(_tokenise_unit, jobs):
                        advance(out["input_bytes"])
            except BrokenProcessPool:
                raise ValueError("data.workers: a tokenising process died (out of memory, killed, or started from a "
                                 "script without `if __name__ == '__main__':`, which multiprocessing's spawn needs); "
                                 "data.workers=1 tokenises in this process") from None
    seconds = time.perf_counter() - t1
    stats = [json.loads((folder / f"unit-{i:05d}.json").read_text()) for i in range(len(units))]
    held = _held(data)  # the validation documents in val_docs' order, as the in-memory stream had them
    order = {"train": range(len(units)), "val": sorted(range(len(units)), key=lambda i: (
        held.index(units[i][0].name) if units[i][0].name in held else -1, i))}
    splits = {s: {"shards": [stats[i][s] for i in order[s] if stats[i][s]["tokens"]],
                  **{k: sum(u[s][k] for u in stats) for k in ("tokens", "bytes", "docs")}} for s in SPLITS}
    skipped += [s for u in stats for s in u["skipped"]]
    meta = {"version": VERSION, "corpus": data.corpus, "tokenizer": data.tokenizer.kind, "eod": eod,
            "dtype": _dtype(data), "splits": splits, "skipped": skipped,
            "tokenise_mb_per_s": round(total / 2 ** 20 / max(seconds, 1e-9), 2)}
    _atomic_write(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    if skipped:
        log(f"data.corpus: skipped {len(skipped)} unreadable or invalid inputs (data.invalid_utf8: skip): "
            f"{', '.join(skipped[:20])}{' ...' if len(skipped) > 20 else ''}")
    log(f"prepare: {splits['train']['tokens']:,} training and {splits['val']['tokens']:,} validation tokens "
        f"({splits['val']['bytes'] / max(splits['val']['tokens'], 1):.3f} bytes per token) in "
        f"{time.perf_counter() - t0:.1f} s ({meta['tokenise_mb_per_s']} MB/s tokenising)")


class _progress:
    """A progress bar on stderr (a terminal only): advance(bytes) after each shard."""

    def __init__(self, total: int):
        self.total, self.bar = total, None

    def __enter__(self):
        if sys.stderr.isatty() and self.total:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

            self.bar = Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("prepare", total=self.total)
            self.bar.start()
        return lambda n: self.bar and self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()


def bits_per_byte(loss: float, prepared: Prepared) -> float:
    """Validation loss in nats per token as bits per byte of the validation text."""
    return loss * prepared.tokens_per_byte("val") / math.log(2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.prepare", description="Tokenise a config's corpus into "
                                "memory-mapped shards under $ZOO_CACHE (python -m train does it on demand).")
    p.add_argument("config", help="a YAML run config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. data.corpus=/data/text data.workers=8")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.data.task is not None:
            raise ValueError("data.task: a synthetic task has no corpus to prepare")
        prepared = prepare(cfg.data)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(prepared.folder)


if __name__ == "__main__":
    main()
