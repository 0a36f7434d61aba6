"""What a run writes and prints while it trains: metrics.jsonl (one JSON object per logged step), the
console lines, a rich progress bar on a terminal, the timing of the step against everything around
it, and loss.png at the end (when matplotlib is installed).

Only process 0 of a multi-process run writes and prints; the others get a Report that keeps quiet.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from train import optim
from train.resume import metrics_upto
from train.utilisation import flops_per_token, products_rate
from zoo.config import Config


def plot(run_dir: Path):
    """loss.png: train and validation loss against tokens; skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="tokens", ylabel="loss (nats/token)", title=run_dir.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)


def layer_metrics(layers: dict) -> dict:
    """Per-step metrics that layers sowed, for metrics.jsonl: scalars averaged over layers (MoE:
    aux/balance/z losses, dropped fraction, router entropy), vectors kept per layer (tokens per expert)."""
    return {name: np.asarray(v).tolist() if np.ndim(v) > 1 else round(float(np.mean(v)), 6)
            for name, v in layers.items()}


def _progress_bar(steps: int, start: int):
    """A rich progress bar (step, loss, lr, tokens/s) when stdout is a terminal; None otherwise."""
    if not sys.stdout.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[status]}"))
    bar.add_task("train", total=steps, completed=start, status="")
    return bar


class Report:
    """The run's metrics file, console and progress bar, and its clock: the time inside the jitted
    step, in evaluation, and the tokens of the current logging window (for tokens/s). A context
    manager around the steps: it opens metrics.jsonl for appending and shows the bar."""

    def __init__(self, cfg: Config, run_dir: Path, log, primary: bool, started: float):
        self.cfg, self.path, self.primary, self.started = cfg, run_dir / "metrics.jsonl", primary, started
        self.log = log if primary else lambda *_: None
        self.unit = "byte" if cfg.data.tokenizer.kind == "bytes" else "token"
        self.lr_at = optim.schedule(cfg.train)
        self.bar = self.file = None
        self.start = 0  # the step the run resumes from
        self.step_time = self.eval_time = 0.0  # seconds inside the jitted step, in evaluation
        self.window_start, self.window_tokens = started, 0  # the logging window, for tokens/s
        self.flops_per_token = self.rate = None  # set by measure_utilisation

    def measure_utilisation(self, model):
        """Model FLOPs utilisation for every logged row (train/utilisation.py): the model's FLOPs per
        token and the products' rate of the devices (measured on CPU, whose devices share one machine)."""
        self.flops_per_token = flops_per_token(model, self.cfg.train.seq_len)
        platform = jax.devices()[0].platform
        self.rate = products_rate() * (1 if platform == "cpu" else jax.device_count())

    def resume(self, start: int) -> dict:
        """Keep metrics.jsonl up to step `start` (dropping a torn line); the last row kept ({} if none)."""
        self.start = start
        kept = metrics_upto(self.path, start, self.log)
        if self.primary:
            self.path.write_text("".join(line + "\n" for line in kept))
        return json.loads(kept[-1]) if start > 0 and kept else {}

    def __enter__(self):
        self.bar = _progress_bar(self.cfg.train.steps, self.start) if self.log is print else None
        if self.bar:
            self.log = self.bar.console.print
            self.bar.__enter__()
        self.file = self.path.open("a") if self.primary else open(os.devnull, "w")
        self.wall0 = self.window_start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.file.close()
        if self.bar:
            self.bar.__exit__(*exc)

    def stepped(self, step: int, seconds: float):
        """After each step: `seconds` in the jitted step; the first step's message; the bar."""
        self.step_time += seconds
        if step == self.start + 1:
            self.log(f"first step done {time.perf_counter() - self.started:.1f} s after the start, compiles included "
                     f"(compiled programs are kept in {jax.config.jax_compilation_cache_dir}: a second run loads them)")
        self.window_tokens += self.cfg.train.batch_size * self.cfg.train.seq_len
        if self.bar:
            self.bar.update(0, completed=step)

    @contextlib.contextmanager
    def evaluating(self):
        """Times an evaluation: it is left out of the step's share of the training time."""
        e0 = time.perf_counter()
        yield
        self.eval_time += time.perf_counter() - e0

    def row(self, step: int, m: dict, skipped: int) -> dict:
        """The metrics.jsonl row of a step from its metrics `m` (numpy), before any evaluation."""
        t = self.cfg.train
        row = {"step": step, "tokens": step * t.batch_size * t.seq_len, "loss": float(m["loss"]),
               "lr": float(self.lr_at(step - 1)), "grad_norm": float(m["grad_norm"]),
               "tokens_per_s": round(self.window_tokens / (time.perf_counter() - self.window_start), 1),
               "skipped": skipped}
        if self.rate:
            row["mfu"] = round(row["tokens_per_s"] * self.flops_per_token / self.rate, 4)
        return row | layer_metrics(m["layers"])

    def write(self, row: dict):
        """Append `row` to metrics.jsonl, print it (and its sample), and start a new logging window."""
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        val = (f"  val {row['val_loss']:.4f} nats/{self.unit} ({row['val_bpb']:.3f} bpb)" if "val_bpb" in row
               else f"  val {row['val_loss']:.4f}  accuracy {row['val_accuracy']:.4f}" if "val_loss" in row
               else "")
        status = f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s" + \
            (f"  mfu {row['mfu']:.1%}" if "mfu" in row else "")
        self.log(f"step {row['step']:>6}/{self.cfg.train.steps}  {status}" + val)
        if "sample" in row:
            self.log("  sample: " + row["sample"].replace("\n", "\n  "))
        if self.bar:
            self.bar.update(0, status=status)
        self.window_start, self.window_tokens = time.perf_counter(), 0

    def done(self, last: dict):
        """The closing line (the share of training time spent outside the jitted step) and loss.png."""
        wall = time.perf_counter() - self.wall0
        last["overhead"] = 1 - self.step_time / max(wall - self.eval_time, 1e-9)
        self.log(f"done: {last['step']} steps{' (stop_at_accuracy reached)' if last.get('stopped_early') else ''}; "
                 f"{last['overhead']:.1%} of training time outside the jitted step "
                 f"(data, logging, checkpoints; evaluation excluded)")
        if self.primary:
            plot(self.path.parent)
