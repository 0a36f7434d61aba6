"""Long-context retrieval: a run trained on a retrieval task (`needle`, `needle_multikey`,
`needle_multivalue`, `needle_multiquery`, `variable_tracking`; zoo/tasks.py) evaluated by length and
needle depth, as RULER (Hsieh et al. 2024) and the needle-in-a-haystack picture do.

    python -m train.needle RUN_DIR [--lengths 256 1024 4096] [--depths 0 0.25 0.5 0.75 1] [--examples 32]

Each cell (length, depth) draws `--examples` test examples of the run's task at that length with the
asked needle at that depth (the same seeds in every cell: the same keys and values, moved) and scores
an example right when every answer token is the model's argmax after the tokens before it (exact
match of the whole answer, teacher-forced, in one full pass). Attention past its trained context does
as its `long_context` says; recurrent kinds run on from their state. The table goes to
RUN_DIR/needle.json, the heatmap (accuracy by length and depth) to RUN_DIR/needle.png.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.tasks import example
from zoo.checkpoint import load_model
from zoo.schema import to_dict
from zoo.tasks import NeedleTask


@nnx.jit
def _hits(model, x, y):
    return jnp.argmax(model(x), axis=-1) == y


def accuracy(model, task: NeedleTask, length: int, depth: float, examples: int = 32, batch_size: int = 8) -> float:
    """The fraction of `examples` test examples at `length` tokens, needle at `depth`, answered exactly."""
    c = dataclasses.replace(task, depth=depth)
    right = 0
    for start in range(0, examples, batch_size):
        x, y, mask = (np.stack(a) for a in zip(*(example(c, "test", i, length)
                                                 for i in range(start, min(start + batch_size, examples)))))
        hit = np.asarray(_hits(model, jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32)))
        right += int((hit | (mask == 0)).all(axis=1).sum())
    return right / examples


def evaluate(model, cfg, lengths, depths, examples: int = 32) -> dict:
    """The table: the settings and `accuracy[i][j]` at lengths[i], depths[j]."""
    task = cfg.data.task
    if not isinstance(task, NeedleTask):
        raise ValueError(f"data.task: the run was trained on {task.KIND if task else 'text'}; expected a retrieval "
                         f"task (needle, needle_multikey, needle_multivalue, needle_multiquery, variable_tracking)")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths: expected fractions in [0, 1], got {list(depths)}")
    if examples < 1:
        raise ValueError(f"--examples: expected a positive integer, got {examples}")
    for n in lengths:
        try:
            task.check(n, "data.task")
        except ValueError as e:
            raise ValueError(f"--lengths: {n} tokens are too few for the run's task ({e})") from None
    model.eval()
    table = []
    for n in lengths:
        try:
            table.append([round(accuracy(model, task, n, d, examples), 4) for d in depths])
        except ValueError as e:  # a layer that refuses the length (attention's dynamic rope scaling past its context)
            raise ValueError(f"--lengths: the model cannot take {n} tokens: {e}") from None
    return {"task": to_dict(task), "trained_length": cfg.train.seq_len,
            "examples": examples, "lengths": list(lengths), "depths": list(depths), "accuracy": table}


def plot(result: dict, path: Path, title: str):
    """The heatmap: depth down, length across, accuracy as colour and number; skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no heatmap")
        return
    acc = np.array(result["accuracy"]).T  # (depths, lengths)
    fig, ax = plt.subplots(figsize=(1.2 * len(result["lengths"]) + 2, 0.6 * len(result["depths"]) + 1.5))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for (i, j), a in np.ndenumerate(acc):
        ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(result["lengths"])), result["lengths"])
    ax.set_yticks(range(len(result["depths"])), result["depths"])
    ax.set(xlabel=f"context length (tokens; trained at {result['trained_length']})", ylabel="needle depth",
           title=title)
    fig.colorbar(im, label="exact-match accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.needle", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths in tokens (default: 1x, 4x and 16x the trained length)")
    p.add_argument("--depths", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1])
    p.add_argument("--examples", type=int, default=32, help="test examples per cell (default: %(default)s)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        if args.lengths is not None and any(n < 1 for n in args.lengths):
            raise ValueError(f"--lengths: expected positive integers, got {args.lengths}")
        cfg, model, step = load_model(args.run_dir)
        lengths = args.lengths or [f * cfg.train.seq_len for f in (1, 4, 16)]
        result = {"run": str(args.run_dir), "step": step, **evaluate(model, cfg, lengths, args.depths, args.examples)}
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"# {args.run_dir}, checkpoint step {step}, {result['task']['kind']} trained at {cfg.train.seq_len} tokens")
    print("depth  " + "".join(f"{n:>8}" for n in lengths))
    for j, d in enumerate(args.depths):
        print(f"{d:<7}" + "".join(f"{row[j]:>8.3f}" for row in result["accuracy"]))
    run = Path(args.run_dir)
    (run / "needle.json").write_text(json.dumps(result, indent=1))
    plot(result, run / "needle.png", f"{run.name}: {result['task']['kind']}, step {step}")


if __name__ == "__main__":
    main()
