"""Validation loss of every config after the same training budget, one table.

    python -m benchmarks.compare [--configs configs/a.yaml ...] [--steps 300] [--set key=value ...]

Each config trains from scratch with the same steps, batch, sequence length and seed (overrides
apply to all), in runs/compare/<name>; the table gives parameters, final validation loss in nats per
byte (and bits per byte), wall time and training tokens/s on this machine.
"""

import argparse
import json
import time
from pathlib import Path

import jax
from flax import nnx

from benchmarks.common import print_table, save_json
from train.loop import run
from zoo import LanguageModel, load_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=sorted(str(c) for c in Path("configs").glob("*.yaml")))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--set", nargs="*", default=[], dest="overrides", help="dotted.key=value for every config")
    args = p.parse_args()
    rows = []
    for path in args.configs:
        over = [f"train.steps={args.steps}", f"train.eval_every={args.steps}", "train.sample_tokens=0",
                f"train.checkpoint_every={args.steps}", "train.log_every=50", *args.overrides]
        cfg = load_config(path, over)
        run_dir = Path("runs/compare") / Path(path).stem
        if run_dir.exists():
            import shutil
            shutil.rmtree(run_dir)
        params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
            lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)))
        t0 = time.perf_counter()
        last = run(cfg, run_dir, log=lambda _: None)
        wall = time.perf_counter() - t0
        rows.append({"config": Path(path).stem, "params": params, "val_loss": round(last["val_loss"], 4),
                     "val_bpb": round(last["val_bpb"], 3), "wall_s": round(wall, 1),
                     "train_tok_per_s": round(last["step"] * cfg.train.batch_size * cfg.train.seq_len / wall)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.steps} steps each, device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print_table(rows, ["config", "params", "val_loss", "val_bpb", "wall_s", "train_tok_per_s"])
    save_json("compare", rows)


if __name__ == "__main__":
    main()
