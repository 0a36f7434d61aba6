"""A grid of runs: mixer kinds x widths x sequence lengths x learning rates x seeds, as Zoology's
(Arora et al. 2023) comparisons are made.

    python -m train.sweep [configs/sweeps/mqar.yaml] [--zoology] [--workers 2] [--out runs/sweep]

A sweep file has `base` (a run config every cell starts from), `mixers` (name -> model.mixer, or
`all`: every registered kind with its defaults), `d_model`, `seq_len` (a list, or a mapping from
each length to the overrides that go with it, e.g. the number of MQAR pairs), `lr`, `seeds`, and
optionally `match` ({by: params | state, reference: <mixer name>}: each kind's width is chosen so
its parameter count, or its decode-state bytes per sequence, is closest to the reference kind's at
each width of the grid: the field's two conventions for a fair comparison).

Every cell is an ordinary run in `<out>/cells/<cell>/`, so a killed sweep resumes: finished cells
are skipped (reused) and an interrupted one resumes from its checkpoint, bitwise. Every cell's config
is checked before any runs. Cells run in `--workers` processes; a line is printed as each finishes
and, on a terminal or in a Jupyter notebook, a bar over every step of the grid shows each running
cell's step. A cell whose base sets train.stop_at_accuracy ends at the first evaluation that reaches
it (its row says at which step).
The best learning rate of each (kind, width, length) is kept, as Zoology does (the mean over seeds
decides), and the sweep writes `results.jsonl` (every cell), `table.md` and `accuracy.png` (accuracy
against width per kind, one panel per sequence length, as Zoology's Figure 2).
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import yaml
from flax import nnx
from tqdm import tqdm

from zoo.config import apply_overrides, from_dict
from zoo.model import LanguageModel
from zoo.registry import MIXERS

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "sweeps" / "mqar.yaml"
ZOOLOGY = DEFAULT.with_name("zoology_fig2.yaml")
KEYS = ("base", "mixers", "d_model", "seq_len", "lr", "seeds", "match")


@dataclasses.dataclass(frozen=True)
class Cell:
    mixer: str
    d_model: int  # the grid's width (the row's column); the run's own width may differ under `match`
    seq_len: int
    lr: float
    seed: int
    config: dict  # the run config

    @property
    def name(self) -> str:
        return f"{self.mixer}-d{self.d_model}-L{self.seq_len}-lr{self.lr:g}-s{self.seed}"


def load_grid(path) -> dict:
    grid = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(grid, dict):
        raise ValueError(f"sweep {path}: expected a mapping of {', '.join(KEYS)}, got {type(grid).__name__} {grid!r}")
    unknown = [k for k in grid if k not in KEYS]
    if unknown:
        raise ValueError(f"sweep {path}: unknown keys {unknown}; expected {', '.join(KEYS)}")
    for key in ("base", "mixers", "d_model", "seq_len", "lr"):
        if key not in grid:
            raise ValueError(f"sweep {path}: missing {key!r}")
    if grid["mixers"] == "all":
        grid["mixers"] = {kind: {"kind": kind} for kind in MIXERS}
    if isinstance(grid["seq_len"], list):
        grid["seq_len"] = {L: {} for L in grid["seq_len"]}
    grid.setdefault("seeds", [0])
    for key in ("base", "mixers"):
        if not isinstance(grid[key], dict):
            raise ValueError(f"sweep {path}: {key}: expected a mapping, got {type(grid[key]).__name__} {grid[key]!r}")
    match = grid.get("match")
    if match is not None and (not isinstance(match, dict) or set(match) != {"by", "reference"}
                              or match["by"] not in ("params", "state") or match["reference"] not in grid["mixers"]):
        raise ValueError(f"sweep {path}: match: expected {{by: params or state, reference: one of "
                         f"{', '.join(grid['mixers'])}}}, got {match!r}")
    return grid


def _config(grid, mixer: dict, d_model: int, seq_len: int, lr: float, seed: int) -> dict:
    data = json.loads(json.dumps(grid["base"]))
    data.setdefault("model", {})["mixer"] = mixer
    data["model"]["d_model"] = d_model
    overrides = [f"train.seq_len={seq_len}", f"train.lr={lr}", f"train.seed={seed}"]
    overrides += [f"{k}={json.dumps(v)}" for k, v in (grid["seq_len"][seq_len] or {}).items()]
    return apply_overrides(data, overrides)


def sizes(config: dict) -> tuple[int, int]:
    """(parameters, decode-state bytes of one sequence of train.seq_len tokens) of a run config."""
    cfg = from_dict(config)

    def shapes():  # one trace; the state inside it, as a state may be computed from the parameters (Hyena's taps)
        model = LanguageModel(cfg.model, rngs=nnx.Rngs(0))
        return nnx.state(model, nnx.Param), model.init_state(1, cfg.train.seq_len)

    params, state = jax.eval_shape(shapes)
    params = sum(x.size for x in jax.tree.leaves(params))
    return params, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def _matched_width(grid, name: str, seq_len: int, target: int, by: int) -> int:
    """The width (a multiple of 16, valid for the kind) whose parameters (by=0) or state bytes (by=1)
    are closest to `target`."""
    best = None
    for d in range(16, 4097, 16):
        try:
            size = sizes(_config(grid, grid["mixers"][name], d, seq_len, grid["lr"][0], 0))[by]
        except ValueError:
            continue
        if best is None or abs(size - target) < abs(best[1] - target):
            best = (d, size)
        if size > target:
            break
    if best is None:
        raise ValueError(f"sweep: no width of 16..4096 is valid for mixer {name!r} at seq_len={seq_len}")
    return best[0]


def cells(grid) -> list[Cell]:
    """Every cell of the grid, each config checked (a ValueError names the cell)."""
    match = grid.get("match")
    out = []
    for L in grid["seq_len"]:
        for d in grid["d_model"]:
            target = None
            if match:
                by = ("params", "state").index(match["by"])
                ref = grid["mixers"][match["reference"]]
                target = sizes(_config(grid, ref, d, L, grid["lr"][0], 0))[by]
            for name, mixer in grid["mixers"].items():
                width = _matched_width(grid, name, L, target, by) if match else d
                for lr in grid["lr"]:
                    for seed in grid["seeds"]:
                        config = _config(grid, mixer, width, L, lr, seed)
                        try:
                            from_dict(config)
                        except ValueError as e:
                            raise ValueError(f"sweep cell {name} d_model={width} seq_len={L}: {e}") from None
                        out.append(Cell(name, d, L, float(lr), int(seed), config))
    return out


def _finished(run_dir: Path, steps: int) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    last = [r for r in rows if "val_loss" in r]
    return last[-1] if last and (last[-1]["step"] == steps or last[-1].get("stopped_early")) else None


def run_cell(cell: Cell, out: Path) -> dict:
    """Train one cell (resuming it if it was interrupted) in a process of its own; its result row."""
    run_dir = out / "cells" / cell.name
    steps = from_dict(cell.config).train.steps
    if _finished(run_dir, steps) is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "cell.yaml").write_text(yaml.safe_dump(cell.config, sort_keys=False))
        log = (run_dir / "train.log").open("a")
        subprocess.run([sys.executable, "-m", "train", str(run_dir / "cell.yaml"), f"train.run_dir={run_dir}"],
                       check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last = _finished(run_dir, steps)
    params, state = sizes(cell.config)
    return {"mixer": cell.mixer, "d_model": cell.d_model, "width": cell.config["model"]["d_model"],
            "seq_len": cell.seq_len, "lr": cell.lr, "seed": cell.seed, "params": params, "state_bytes": state,
            "val_accuracy": last.get("val_accuracy"), "val_loss": last["val_loss"], "steps": last["step"],
            "tokens_per_s": last.get("tokens_per_s")}


def best_lr(rows: list[dict]) -> list[dict]:
    """One row per (mixer, d_model, seq_len): the learning rate with the best mean accuracy over seeds
    (or the lowest mean loss where there is no accuracy)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["mixer"], r["d_model"], r["seq_len"]), {}).setdefault(r["lr"], []).append(r)
    out = []
    for (mixer, d, L), by_lr in groups.items():
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
        score = lambda rs: mean(rs, "val_accuracy") if rs[0]["val_accuracy"] is not None else -mean(rs, "val_loss")
        lr, rs = max(by_lr.items(), key=lambda kv: (score(kv[1]), -kv[0]))
        out.append({"mixer": mixer, "d_model": d, "seq_len": L, "lr": lr, "width": rs[0]["width"],
                    "params": rs[0]["params"], "state_bytes": rs[0]["state_bytes"],
                    "val_accuracy": None if rs[0]["val_accuracy"] is None else round(mean(rs, "val_accuracy"), 4),
                    "val_loss": round(mean(rs, "val_loss"), 4), "seeds": len(rs), "steps": max(r["steps"] for r in rs)})
    return out


def table(best: list[dict]) -> str:
    """Markdown: a row per mixer, a column per (seq_len, d_model), the best-lr accuracy in each; then
    each cell's parameters and decode-state bytes (the two equal-footing measures)."""
    cols = sorted({(r["seq_len"], r["d_model"]) for r in best})
    mixers = list(dict.fromkeys(r["mixer"] for r in best))
    at = {(r["mixer"], r["seq_len"], r["d_model"]): r for r in best}
    head = "| mixer | " + " | ".join(f"L={L} d={d}" for L, d in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for m in mixers:
        cells_ = []
        for L, d in cols:
            r = at.get((m, L, d))
            value = "" if r is None else f"{r['val_accuracy']:.3f}" if r["val_accuracy"] is not None \
                else f"{r['val_loss']:.3f}"
            cells_.append(value)
        lines.append(f"| {m} | " + " | ".join(cells_) + " |")
    lines += ["", "| mixer | seq_len | d_model | width | parameters | decode state (bytes per sequence) | steps |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(best, key=lambda r: (mixers.index(r["mixer"]), r["seq_len"], r["d_model"])):
        lines.append(f"| {r['mixer']} | {r['seq_len']} | {r['d_model']} | {r['width']} | {r['params']:,} | "
                     f"{r['state_bytes']:,} | {r['steps']} |")
    return "\n".join(lines) + "\n"


def plot(best: list[dict], path: Path):
    """accuracy.png: accuracy against width per mixer, one panel per sequence length (Zoology Fig. 2)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lengths = sorted({r["seq_len"] for r in best})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False, sharey=True)
    for ax, L in zip(axes[0], lengths):
        for m in dict.fromkeys(r["mixer"] for r in best):
            rs = sorted((r for r in best if r["mixer"] == m and r["seq_len"] == L), key=lambda r: r["d_model"])
            ax.plot([r["d_model"] for r in rs], [r["val_accuracy"] or 0 for r in rs], "o-", label=m)
        ax.set(xscale="log", xlabel="model width", title=f"sequence length {L}", ylim=(-0.02, 1.02))
        ax.minorticks_off()
        ax.set_xticks(sorted({r["d_model"] for r in best}), [str(d) for d in sorted({r["d_model"] for r in best})])
    axes[0][0].set_ylabel("held-out accuracy")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _logged_step(run_dir: Path) -> int:
    """The last step a cell's metrics.jsonl holds (0 before its first row); a line being written is skipped."""
    path = run_dir / "metrics.jsonl"
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        try:
            return json.loads(line)["step"]
        except json.JSONDecodeError:
            continue
    return 0


class _Progress:
    """What a sweep shows while it runs: a line per finished cell (through `log`) and, when `log` is print
    and stdout redraws in place (a terminal, or a Jupyter notebook's stream), a bar over every step of the
    grid with each running cell's step beside it. A finished cell counts all its train.steps, even if it
    stopped early. Made before any cell runs: the cells already finished then are the reused ones."""

    def __init__(self, todo: list[Cell], out: Path, log):
        self.todo, self.out = todo, out
        self.steps = [from_dict(c.config).train.steps for c in todo]
        self.reused = [_finished(out / "cells" / c.name, n) is not None for c, n in zip(todo, self.steps)]
        live = sys.stdout.isatty() or type(sys.stdout).__module__.startswith("ipykernel")
        self.bar = tqdm(total=sum(self.steps), desc=f"0/{len(todo)} cells", unit="step", file=sys.stdout) \
            if log is print and live else None
        self.log = tqdm.write if self.bar else log

    def watch(self, futures: list[concurrent.futures.Future]):
        """Until every cell is done (or one fails): a line as each finishes, the bar redrawn every second."""
        pending = set(range(len(futures)))
        try:
            while pending:
                concurrent.futures.wait([futures[i] for i in pending], timeout=1,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                for i in sorted(i for i in pending if futures[i].done()):
                    pending.remove(i)
                    r = futures[i].result()
                    self.log(f"  [{len(futures) - len(pending)}/{len(futures)}] {self.todo[i].name}: accuracy "
                             f"{r['val_accuracy']}, loss {r['val_loss']:.4f} at step {r['steps']}"
                             + (" (reused)" if self.reused[i] else ""))
                if self.bar:
                    self._draw(futures, pending)
        finally:
            if self.bar:
                self.bar.close()

    def _draw(self, futures: list[concurrent.futures.Future], pending: set[int]):
        running = sorted(i for i in pending if futures[i].running())
        at = {i: _logged_step(self.out / "cells" / self.todo[i].name) for i in running}
        self.bar.set_description_str(f"{len(futures) - len(pending)}/{len(futures)} cells", refresh=False)
        self.bar.set_postfix_str("; ".join(f"{self.todo[i].name} step {at[i]}/{self.steps[i]}" for i in running),
                                 refresh=False)
        self.bar.update(sum(n for i, n in enumerate(self.steps) if i not in pending) + sum(at.values()) - self.bar.n)


def sweep(grid: dict, out: Path, workers: int = 1, log=print) -> list[dict]:
    """Run (or resume) every cell, showing progress (`_Progress`), then write results.jsonl, table.md and
    accuracy.png in `out`; every cell's row, in the grid's order."""
    todo = cells(grid)
    out.mkdir(parents=True, exist_ok=True)
    log(f"sweep: {len(todo)} cells in {out}/cells ({workers} at a time)")
    progress = _Progress(todo, out, log)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # each cell trains in its own process
        futures = [pool.submit(run_cell, c, out) for c in todo]
        progress.watch(futures)
    rows = [f.result() for f in futures]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    best = best_lr(rows)
    (out / "table.md").write_text(table(best))
    plot(best, out / "accuracy.png")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("grid", nargs="?", help=f"a sweep file (default {DEFAULT.relative_to(DEFAULT.parents[2])})")
    p.add_argument("--zoology", action="store_true", help="the full Zoology Figure-2 grid (zoology_fig2.yaml)")
    p.add_argument("--workers", type=int, default=1, help="cells trained at once, each in its own process")
    p.add_argument("--out", default=None, help="output folder (default runs/sweep-<grid name>)")
    return p


def grid_path(args) -> Path:
    return Path(args.grid) if args.grid else ZOOLOGY if args.zoology else DEFAULT


def main(argv=None):
    args = parser().parse_args(argv)
    path = grid_path(args)
    try:
        grid = load_grid(path)
        print(table(best_lr(sweep(grid, Path(args.out or f"runs/sweep-{path.stem}"), args.workers))))
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
