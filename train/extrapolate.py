"""Length extrapolation: a trained run evaluated at 1x, 2x, 4x, 8x and 16x its training length.

    python -m train.extrapolate RUN_DIR [--factors 1 2 4 8 16] [--batches 4]

Text runs read validation windows of f x L tokens (L = train.seq_len) and report the loss in each
bucket of L positions: bucket 0 is the trained range, later buckets are positions the model never
trained at. Task runs draw test examples at f x L tokens from the task's own generator (MQAR's
gaps then spread over the longer space, so queries sit farther from their keys) and report the
accuracy. Attention past its trained context behaves as documented (`long_context`: by default a
window of the trained length); recurrent kinds run on from their state. `ratio` is the last
bucket's loss over the first bucket's at 1x (text; above 1: worse past the trained length), or the
accuracy over the accuracy at 1x (task). The figures go to RUN_DIR/extrapolation.json.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train.prepare import prepare
from train.tasks import TaskBatches
from zoo.checkpoint import load_model


@nnx.jit
def _token_losses(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), jnp.argmax(logits, axis=-1) == y


def extrapolate(model, cfg, factors=(1, 2, 4, 8, 16), batches: int = 4, batch_size: int = 8) -> list[dict]:
    """One row per factor: tokens, loss per bucket of train.seq_len positions (text) or accuracy (task)."""
    L, task = cfg.train.seq_len, cfg.data.task
    model.eval()
    corpus = None if task else prepare(cfg.data)
    rows = []
    for f in factors:
        if task:  # a test set at this length, batches x batch_size examples
            source = TaskBatches(dataclasses.replace(task, num_test_examples=batches * batch_size), f * L,
                                 cfg.train.seed)
        else:
            source = corpus.batches(f * L, cfg.train.seed, cfg.data.packing)
        sums, counts, correct = np.zeros(f), np.zeros(f), 0.0
        for i in range(batches):
            b = source.val_batch(i, batch_size)
            loss, hit = (np.asarray(a) for a in _token_losses(model, jnp.asarray(b["x"]), jnp.asarray(b["y"])))
            m = b["mask"]
            sums += (loss * m).reshape(batch_size, f, L).sum(axis=(0, 2))
            counts += m.reshape(batch_size, f, L).sum(axis=(0, 2))
            correct += float((hit * m).sum())
        row = {"factor": f, "tokens": f * L}
        if task:
            row["accuracy"] = round(correct / counts.sum(), 4)
            row["loss"] = round(float(sums.sum() / counts.sum()), 4)
        else:
            row["loss_per_bucket"] = [round(float(s / c), 4) for s, c in zip(sums, counts)]
        rows.append(row)
    base = rows[0]
    for r in rows:
        r["ratio"] = round(r["accuracy"] / max(base["accuracy"], 1e-9), 3) if task else \
            round(r["loss_per_bucket"][-1] / base["loss_per_bucket"][0], 3)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.extrapolate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--batches", type=int, default=4, help="batches of 8 rows per factor (default: %(default)s)")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        if any(f < 1 for f in args.factors):
            raise ValueError(f"--factors: expected positive integers, got {args.factors}")
        cfg, model, step = load_model(args.run_dir)
        rows = extrapolate(model, cfg, tuple(args.factors), args.batches)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"# {args.run_dir}, checkpoint step {step}, trained at {cfg.train.seq_len} tokens")
    for r in rows:
        print(json.dumps(r))
    (Path(args.run_dir) / "extrapolation.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
