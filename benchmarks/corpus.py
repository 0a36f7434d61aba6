"""Corpora beyond Shakespeare: prepare's throughput, a training run's peak memory against the corpus
size, and bytes against a BPE vocabulary in bits per byte. Prints one table per part.

    python -m benchmarks.corpus [--small-mb 20] [--big-mb 2048] [--bpe-mb 20] [--compare-steps 300] [--workers 2]

The corpora are generated, under runs/corpus/ (git-ignored), by the same command with --generate:

    python -m benchmarks.corpus --generate runs/corpus/words-2048MB --mb 2048

JSONL files of 64 MB whose documents are 20-400 random lines of Shakespeare's training plays (the
default split's), each document a different draw, so the text is real English and no two documents
are alike. A corpus already there is reused.

1. Throughput: `python -m train.prepare` with `--workers` processes on the small corpus (bytes and a
   4096-token BPE) and the big one (bytes): MB of input text per second of tokenising (the BPE's
   training is timed apart), process start included.
2. Peak resident memory (ru_maxrss of the child, os.wait4) of `python -m train` for 20 steps of
   configs/transformer.yaml on each corpus, prepared beforehand: the shards are read window by window
   (os.pread), so it should not grow with the corpus.
3. configs/transformer.yaml on Shakespeare with bytes and with a 2048-token BPE for the same steps,
   batch and sequence length (so about the same training time, both printed): validation bits per byte.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import print_table, save_json

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def generate(folder: Path, mb: float, seed: int = 0):
    """JSONL files of documents made of random runs of Shakespeare's lines (see the docstring)."""
    from train.corpus import corpus_files
    from zoo.config import DataConfig

    if (folder / "done").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    held = DataConfig().val_docs
    lines = [line for f, name in corpus_files("shakespeare") if name not in held
             for line in f.read_text().splitlines(keepends=True) if line.strip()]
    rng, written, part = np.random.default_rng(seed), 0, 0
    while written < mb * 2 ** 20:
        with open(folder / f"part-{part:04d}.jsonl", "w") as out:
            size = 0
            while size < 64 * 2 ** 20 and written + size < mb * 2 ** 20:
                start = rng.integers(len(lines))
                row = json.dumps({"text": "".join(lines[start: start + rng.integers(20, 400)])}) + "\n"
                out.write(row)
                size += len(row)
        written, part = written + size, part + 1
    (folder / "done").write_text("")


def prepare(folder: Path, workers: int, tokenizer: str, cache: Path) -> dict:
    overrides = [f"data.corpus={folder}", "data.val_fraction=0.01", f"data.workers={workers}",
                 f"data.tokenizer={tokenizer}", "model.vocab_size=null"]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "train.prepare", "configs/transformer.yaml", *overrides],
                         cwd=ROOT, env={**ENV, "ZOO_CACHE": str(cache)}, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    meta = json.loads((Path(out.stdout.strip().splitlines()[-1]) / "meta.json").read_text())
    trained = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if "BPE trained in" in line]
    return {"corpus": folder.name, "tokenizer": tokenizer, "MB": round(sum(
        f.stat().st_size for f in folder.glob("*.jsonl")) / 2 ** 20), "prepare_s": round(time.perf_counter() - t0, 1),
        "bpe_training": trained[0].split("trained in ")[1].split(" (")[0] if trained else "",
        "tokenise_MB_per_s": meta["tokenise_mb_per_s"],
        "bytes_per_token": round(meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"], 3)}


def peak_memory(folder: Path, cache: Path, run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a finished one
    cmd = [sys.executable, "-m", "train", "configs/transformer.yaml", f"data.corpus={folder}", "data.val_fraction=0.01",
           "train.steps=20", "train.eval_every=20", "train.checkpoint_every=1000", "train.sample_tokens=0",
           f"train.run_dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "ZOO_CACHE": str(cache)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        sys.exit(proc.stderr.read().decode()[-3000:])
    return {"corpus": folder.name, "peak_rss_MB": round(usage.ru_maxrss / 1024), "seconds": round(
        time.perf_counter() - t0, 1)}


def compare(steps: int, cache: Path) -> list[dict]:
    rows = []
    for name, tok in (("bytes", "{kind: bytes}"), ("bpe-2048", "{kind: bpe, vocab_size: 2048}")):
        run_dir = ROOT / "runs" / "corpus" / f"shakespeare-{name}-{steps}"
        shutil.rmtree(run_dir, ignore_errors=True)
        data = ["configs/transformer.yaml", f"data.tokenizer={tok}", "model.vocab_size=null"]
        subprocess.run([sys.executable, "-m", "train.prepare", *data], cwd=ROOT, check=True,
                       env={**ENV, "ZOO_CACHE": str(cache)}, capture_output=True)  # not timed
        cmd = [sys.executable, "-m", "train", *data, f"train.steps={steps}", f"train.eval_every={steps}",
               f"train.checkpoint_every={steps}", "train.sample_tokens=0", f"train.run_dir={run_dir}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env={**ENV, "ZOO_CACHE": str(cache)}, check=True, capture_output=True)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        rows.append({"tokenizer": name, "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
                     "val_nats_per_token": round(last["val_loss"], 4), "val_bpb": round(last["val_bpb"], 4)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generate", type=Path, help="only write a generated corpus of --mb MB into this folder")
    p.add_argument("--mb", type=float, default=20)
    p.add_argument("--small-mb", type=float, default=20)
    p.add_argument("--big-mb", type=float, default=2048)
    p.add_argument("--bpe-mb", type=float, default=20)
    p.add_argument("--compare-steps", type=int, default=300, help="0: skip part 3")
    p.add_argument("--skip", nargs="*", default=[], choices=("throughput", "memory"), help="parts not to run")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    if args.generate:
        return generate(args.generate, args.mb)
    base, cache = ROOT / "runs" / "corpus", ROOT / "runs" / "corpus" / "cache"
    small, big = base / f"words-{args.small_mb:g}MB", base / f"words-{args.big_mb:g}MB"
    for folder, mb in ((small, args.small_mb), (big, args.big_mb)):
        t0 = time.perf_counter()
        generate(folder, mb)
        print(f"# corpus {folder}: {time.perf_counter() - t0:.0f} s to generate (0 if it was there)", flush=True)
    bpe = base / f"words-{args.bpe_mb:g}MB"
    generate(bpe, args.bpe_mb)
    rows = [] if "throughput" in args.skip else [prepare(small, args.workers, "{kind: bytes}", cache),
                                                  prepare(bpe, args.workers, "{kind: bpe}", cache),
                                                  prepare(big, args.workers, "{kind: bytes}", cache)]
    if rows:
        print_table(rows, list(rows[0]))
    memory = [] if "memory" in args.skip else [peak_memory(f, cache, base / f"run-{f.name}") for f in (small, big)]
    if memory:
        print_table(memory, list(memory[0]))
    quality = compare(args.compare_steps, cache) if args.compare_steps else []
    if quality:
        print_table(quality, list(quality[0]))
    save_json("corpus", rows + memory + quality)


if __name__ == "__main__":
    main()
