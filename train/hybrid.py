"""KL-guided choice of the layers a hybrid keeps as softmax attention (as arXiv 2512.20569 does):

    python -m train.hybrid runs/STUDENT --keep 2 [--batches 4] [--batch-size 8]

STUDENT is a run of `train.distill.convert` (a student converted from its teacher, distilled). For each
converted layer, the student with that layer alone restored to its teacher's mixer (weights and all) is
scored by its KL divergence from the teacher, per token, on held-out batches; the `--keep` layers whose
restoration lowers the KL most are the ones the hybrid keeps as attention. Prints the table, writes it
to STUDENT/hybrid.json, and prints the `convert.layers` of the hybrid (the converted layers but those).
The usual next step: a new conversion with those layers, distilled like the first.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from train.distill import converted_layers, kl_per_token
from train.prepare import prepare
from train.tasks import TaskBatches


def restored(student, teacher, layer: int):
    """A copy of `student` with the mixer of `layer` replaced by a copy of the teacher's."""
    model = nnx.clone(student)
    model.blocks[layer].mixer = nnx.clone(teacher.blocks[layer].mixer)
    return model


def restoration_kl(student, teacher, layers, batches: list[dict]) -> dict:
    """Mean KL(teacher || model) per token over `batches`, for the student as it is (key None) and with
    each of `layers` restored to the teacher's mixer (key: the layer)."""
    @nnx.jit
    def summed(model, teacher, batch):
        kl = kl_per_token(model(batch["x"]), teacher(batch["x"]))
        return jnp.sum(kl * batch["mask"]), jnp.sum(batch["mask"])

    out = {}
    for key in (None, *layers):
        model = student if key is None else restored(student, teacher, key)
        totals = np.sum([[float(v) for v in summed(model, teacher, b)] for b in batches], axis=0)
        out[key] = totals[0] / totals[1]
    return out


def choose(kl: dict, keep: int) -> list[int]:
    """The `keep` layers whose restoration lowers the KL most (ties: the lower index), ascending."""
    layers = sorted((k for k in kl if k is not None), key=lambda i: (kl[i], i))
    return sorted(layers[:keep])


def held_out(cfg, n: int, batch_size: int) -> list[dict]:
    """n validation batches of the run's data (as train/calibrate.py reads them)."""
    L, task = cfg.train.seq_len, cfg.data.task
    source = TaskBatches(dataclasses.replace(task, num_test_examples=n * batch_size), L, cfg.train.seed) \
        if task else prepare(cfg.data).batches(L, cfg.train.seed, packing=False)
    return [source.val_batch(i, batch_size) for i in range(n)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run folder of train.distill.convert")
    p.add_argument("--keep", type=int, required=True, help="layers the hybrid keeps as attention")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    return p


def main(argv=None):
    from zoo.checkpoint import load_any, load_model

    args = parser().parse_args(argv)
    cfg, student, _ = load_model(args.run_dir)
    distill = cfg.train.distill
    if distill is None or distill.convert is None:
        raise SystemExit(f"{args.run_dir}: not a run of train.distill.convert (its config has no convert section)")
    layers = converted_layers(distill, cfg.model.num_layers)
    if not 0 < args.keep < len(layers):
        raise SystemExit(f"--keep {args.keep}: expected 1 to {len(layers) - 1} of the {len(layers)} converted layers")
    teacher, _ = load_any(distill.teacher)
    student.eval()
    kl = restoration_kl(student, teacher, layers, held_out(cfg, args.batches, args.batch_size))
    kept = choose(kl, args.keep)
    table = [{"restored": k, "kl": round(v, 5)} for k, v in kl.items()]
    for row in table:
        print(f"{'none' if row['restored'] is None else 'layer ' + str(row['restored']):>10}  KL {row['kl']}")
    convert = [i for i in layers if i not in kept]
    (Path(args.run_dir) / "hybrid.json").write_text(json.dumps({"kl": table, "keep": kept, "convert_layers": convert}))
    print(f"keep as attention: {kept}; convert.layers: {convert}")


if __name__ == "__main__":
    main()
