"""SemSA's claim in miniature: per-head calibrated masks against one uniform window at the same density.

    python -m benchmarks.sparse_masks RUN_DIR [--densities 0.15 0.25 0.5] [--batches 4] [--copies 32]

For each density budget, train/calibrate.py picks every head's mask on held-out text; the uniform
baseline gives every head the widest plain window within the same budget. Reported, on held-out
batches the calibration did not see:
- the validation loss of the full model, the uniform window and the calibrated masks;
- retrieval at growing distances: a validation window of the training length L whose last n = 12
  tokens repeat the 12 tokens that started d tokens earlier; the accuracy of the greedy prediction of
  copied tokens 2..12 (each needs the token d positions back), per distance d;
- the effective context of each: the largest tested d at which its copy accuracy stays at least 90%
  of the full model's at that d (MoA's measure, on this model's copying instead of long-document
  retrieval), and the ratio calibrated / uniform that the paper puts at up to 3.9x.
Written to runs/bench/sparse_masks.json.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import print_table, save_json
from train.calibrate import Mask, _arrays, attention_layers, calibrate, uniform
from train.prepare import prepare
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


def copy_accuracy(graphdef, state, masks, tests) -> dict:
    acc = {}
    for d, (x, at, target) in tests.items():
        pred = np.asarray(_predict(graphdef, state, _arrays(masks), jnp.asarray(x)))
        acc[d] = float((pred[:, at] == target).mean())
    return acc


def effective(acc: dict, full: dict) -> int:
    ok = [d for d in acc if acc[d] >= 0.9 * full[d]]
    return max(ok) if ok else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_masks", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--densities", type=float, nargs="+", default=[0.15, 0.25, 0.5])
    p.add_argument("--batches", type=int, default=4, help="held-out batches of 8 to calibrate on (and to report on)")
    p.add_argument("--copies", type=int, default=32, help="rows per copy distance")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg, model, _ = load_model(args.run_dir)
    L, H, n_layers = cfg.train.seq_len, attention_layers(model)[0].num_heads, len(attention_layers(model))
    distances = [d for d in (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384) if d <= L - N_COPY]
    tests = copies(cfg, distances, args.copies, args.seed)
    model.eval()
    graphdef, state = nnx.split(model)
    full = copy_accuracy(graphdef, state, [[Mask()] * H] * n_layers, tests)
    rows = [{"masks": "full", "density": 1.0, "val_loss": None, **{f"copy@{d}": round(a, 3) for d, a in full.items()},
             "effective": effective(full, full)}]
    for budget in args.densities:
        r = calibrate(args.run_dir, budget, args.batches, seed=args.seed, log=print)
        rows[0]["val_loss"] = r["full_loss"]
        calibrated = [[Mask(**m) for m in layer] for layer in r["masks"]]
        for name, masks, dens, loss in (
                (f"uniform window {r['uniform_window']}", [[uniform(L, budget)] * H] * n_layers, r["uniform_density"],
                 r["uniform_loss"]),
                ("calibrated per head", calibrated, r["density"], r["calibrated_loss"])):
            acc = copy_accuracy(graphdef, state, masks, tests)
            rows.append({"masks": name, "density": dens, "val_loss": loss,
                         **{f"copy@{d}": round(a, 3) for d, a in acc.items()}, "effective": effective(acc, full)})
        u, c = rows[-2]["effective"], rows[-1]["effective"]
        rows[-1]["vs_uniform"] = round(c / u, 2) if u else None
        print("# budget", budget, "calibrated masks:", r["masks"])
    print(f"# {args.run_dir}: L = {L}, {n_layers} layers x {H} heads; copy@d: accuracy of copying 11 tokens "
          f"from d back")
    print_table(rows, ["masks", "density", "val_loss", *[f"copy@{d}" for d in distances], "effective", "vs_uniform"])
    save_json("sparse_masks", rows)


if __name__ == "__main__":
    main()
