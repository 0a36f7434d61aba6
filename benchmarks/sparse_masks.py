"""SemSA's claim in miniature: per-head calibrated masks against one uniform window at the same density.

    python -m benchmarks.sparse_masks RUN_DIR [--densities 0.15 0.25 0.5] [--rounds 0 2] [--batches 4] [--copies 32]

For each density budget, train/calibrate.py picks every head's mask on held-out text, once per
number of refinement rounds (0: the single-head profile alone); the uniform baseline gives every
head the widest plain window within the same budget. Reported, on held-out
batches the calibration did not see:
- the validation loss of the full model, the uniform window and the calibrated masks;
- retrieval at growing distances: a validation window of the training length L whose last n = 12
  tokens repeat the 12 tokens that started d tokens earlier; the accuracy of the greedy prediction of
  copied tokens 2..12 (each needs the token d positions back), per distance d;
- the effective context of each: the largest tested d at which its accuracy stays at least 90% of the
  full model's at that d (MoA's measure, on this model's copying or recall instead of long-document
  retrieval), and at least 50%; the ratio calibrated / uniform of each (the paper's: up to 3.9x).
A task run (MQAR, e.g.) reports held-out accuracy instead of loss, and retrieval by distance is
the accuracy on the scored queries grouped by how far back their key's value sits (powers of two).
Written to runs/bench/sparse_masks.json.
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import print_table, save_json
from train.calibrate import Mask, attention_layers, calibrate, mask_arrays, uniform
from train.prepare import prepare
from train.tasks import TaskBatches
from zoo.checkpoint import load_model

N_COPY = 12


@functools.partial(jax.jit, static_argnums=0)
def _predict(graphdef, state, masks: dict, x):
    model = nnx.merge(graphdef, state)
    for i, layer in enumerate(attention_layers(model)):
        for name, a in masks.items():
            setattr(layer, name, a[i])
    return jnp.argmax(model(x), axis=-1)


def copies(cfg, distances, rows: int, seed: int) -> dict:
    """d -> (x, positions, targets): validation windows whose last N_COPY tokens repeat those d back."""
    L = cfg.train.seq_len
    source = prepare(cfg.data).batches(seq_len=L, seed=seed, packing=False)
    x0 = np.asarray(source.val_batch(10_000, rows)["x"])  # far from the calibration's batches
    out = {}
    for d in distances:
        x = x0.copy()
        x[:, L - N_COPY:] = x[:, L - N_COPY - d:L - d]
        at = np.arange(L - N_COPY, L - 1)  # predicting copied tokens 2..N_COPY
        out[d] = (x, at, x[:, at + 1])
    return out


def recalls(cfg, batches: int, seed: int) -> dict:
    """Task runs: d -> (x, positions, targets) of the held-out queries whose key's value sits d back,
    d rounded up to a power of two (from test batches past the calibration's)."""
    source = TaskBatches(dataclasses.replace(cfg.data.task, num_test_examples=64 * 16), cfg.train.seq_len, seed)
    out = {}
    for i in range(2 * batches, 2 * batches + 8):
        b = source.val_batch(i, 16)
        for r, t in zip(*np.nonzero(b["mask"])):
            back = t - np.flatnonzero(b["x"][r, :t] == b["x"][r, t])  # the earlier occurrences of the key
            if len(back):
                d = 1 << int(np.ceil(np.log2(max(1, back[-1] - 1))))  # the value sits back[-1] - 1 back
                out.setdefault(d, []).append((b["x"][r], t, b["y"][r, t]))
    return {d: (np.stack([e[0] for e in v]), np.array([e[1] for e in v]), np.array([e[2] for e in v]))
            for d, v in sorted(out.items())}


def copy_accuracy(graphdef, state, masks, tests) -> dict:
    acc = {}
    for d, (x, at, target) in tests.items():
        pred = np.asarray(_predict(graphdef, state, mask_arrays(masks), jnp.asarray(x)))
        hit = pred[:, at] == target if target.ndim == 2 else pred[np.arange(len(at)), at] == target  # text: (rows, n)
        acc[d] = float(hit.mean())
    return acc


def effective(acc: dict, full: dict, frac: float) -> int:
    """The largest tested distance at which acc keeps `frac` of the full model's accuracy there."""
    ok = [d for d in acc if acc[d] >= frac * full[d]]
    return max(ok) if ok else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_masks", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--densities", type=float, nargs="+", default=[0.15, 0.25, 0.5])
    p.add_argument("--batches", type=int, default=4, help="held-out batches of 8 to calibrate on (and to report on)")
    p.add_argument("--copies", type=int, default=32, help="rows per copy distance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, nargs="+", default=[0, 2], help="calibrate.py's refinement rounds, each a row")
    args = p.parse_args(argv)
    cfg, model, _ = load_model(args.run_dir)
    L, H, n_layers = cfg.train.seq_len, attention_layers(model)[0].num_heads, len(attention_layers(model))
    task = cfg.data.task is not None
    if task:
        tests = recalls(cfg, args.batches, args.seed)
    else:
        tests = copies(cfg, [d for d in (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384) if d <= L - N_COPY],
                       args.copies, args.seed)
    distances = list(tests)
    metric = "val_accuracy" if task else "val_loss"
    model.eval()
    graphdef, state = nnx.split(model)
    full = copy_accuracy(graphdef, state, [[Mask()] * H] * n_layers, tests)
    rows = [{"masks": "full", "density": 1.0, metric: None, **{f"copy@{d}": round(a, 3) for d, a in full.items()},
             "effective_90": effective(full, full, 0.9), "effective_50": effective(full, full, 0.5)}]
    key = "accuracy" if task else "loss"
    for budget in args.densities:
        results = [calibrate(args.run_dir, budget, args.batches, seed=args.seed, rounds=n, log=print)
                   for n in args.rounds]
        r = results[0]
        rows[0][metric] = r[f"full_{key}"]
        variants = [(f"uniform window {r['uniform_window']}", [[uniform(L, budget)] * H] * n_layers,
                     r["uniform_density"], r[f"uniform_{key}"])]
        variants += [(f"calibrated, {n} rounds", [[Mask(**m) for m in layer] for layer in c["masks"]], c["density"],
                      c[f"calibrated_{key}"]) for n, c in zip(args.rounds, results)]
        for name, masks, dens, loss in variants:
            acc = copy_accuracy(graphdef, state, masks, tests)
            rows.append({"masks": name, "density": dens, metric: loss,
                         **{f"copy@{d}": round(a, 3) for d, a in acc.items()},
                         **{f"effective_{p}": effective(acc, full, p / 100) for p in (90, 50)}})
        uniform_row = rows[-len(variants)]
        for row in rows[-len(results):]:
            for p in (90, 50):
                u = uniform_row[f"effective_{p}"]
                row[f"ratio_{p}"] = round(row[f"effective_{p}"] / u, 2) if u else None
        for n, c in zip(args.rounds, results):
            print(f"# budget {budget}, {n} rounds, calibrated masks: {c['masks']}")
    what = "recalling a value up to d back" if task else f"copying {N_COPY - 1} tokens from d back"
    print(f"# {args.run_dir}: L = {L}, {n_layers} layers x {H} heads; copy@d: accuracy of {what}")
    print_table(rows, ["masks", "density", metric, *[f"copy@{d}" for d in distances], "effective_90", "ratio_90",
                       "effective_50", "ratio_50"])
    save_json("sparse_masks", rows)


if __name__ == "__main__":
    main()
