"""Shared bits of the benchmark scripts: timing and table printing."""

import json
import os
import re
import time
from pathlib import Path

import jax


def timeit(fn, *args, repeats: int = 5, warmup: bool = True) -> float:
    """Median seconds of fn(*args), after one warm-up (compile) call unless `warmup` is False."""
    if warmup:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def cpu_model() -> str:
    """The CPU's model name and the cores this process may use (Linux; "?" elsewhere)."""
    try:
        name = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        name = "?"
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def print_table(rows: list[dict], columns: list[str]):
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def save_json(name: str, rows: list[dict]):
    out = Path("runs/bench") / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
