"""A compressed copy of a trained run, as a run folder that `python -m infer` decodes.

    python -m train.compress RUN_DIR --out DIR [--shrink heads=0.25 channels=0.25 experts=0.25 state=0.5]
        [--prune sparsegpt --sparsity 0.5 | --prune wanda --n-of-m 2:4]
        [--quantize int4 --method gptq --group-size 32 --act-order --activations int8 --head int8]
        [--kv-cache int8] [--calibration 32]

The run's latest checkpoint, then in this order (each step optional, at least one): structured pruning
(infer.shrink: the share of every layer's heads, SwiGLU channels, MoE experts or Mamba-2 state channels
removed), pruning (infer.prune: magnitude, wanda or sparsegpt, to --sparsity or --n-of-m), quantization
(infer.quantize: rtn, gptq, awq or smoothquant weights, int8 or int4 (int3: gptq); a pruned model's
zeros stay zero). Calibration: --calibration windows of the run's training data (its corpus or task,
seq_len tokens each, drawn away from the training batches), read by every step that weighs inputs.

DIR gets checkpoints/<the run's step>/ and config.yaml: the run's config with the smaller model of
--shrink (its num_heads, ffn.hidden_dim, num_experts, state_size), no train.qat and no train.run_dir (a
fine-tune names its own), and the run's tokenizer.json. Without --quantize it is an ordinary float run
(its zeros stored): it decodes, evaluates and trains on like any other. With --quantize the checkpoint
holds the codes and scales, and its meta the quantization ("quantized": weights, method, group_size,
activations, kv_cache, head), which zoo.checkpoint.load_model reads into that form
(infer.quantize.quantized_like): it decodes (python -m infer DIR) and evaluates; it does not train.
Factorization (infer.factorize) has no config form and is not written here. Prints the weights' bytes
(int4 codes at half a byte) before and after.
"""

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import jax
import yaml
from flax import nnx

import infer
from infer.quantize import METHODS, weight_bytes
from train.prepare import prepare
from train.tasks import TaskBatches
from zoo import checkpoint
from zoo.config import to_dict


def calibration_tokens(cfg, windows: int):
    """Token ids (windows, seq_len) of the run's training data, drawn as training step 10**6 of seed + 1 (away
    from the batches the run trained on)."""
    t, task = cfg.train, cfg.data.task
    source = TaskBatches(task, t.seq_len, t.seed + 1) if task else \
        prepare(cfg.data).batches(t.seq_len, t.seed + 1, cfg.data.packing)
    return source.train_batch(10**6, windows)["x"]


STEPS = ((infer.shrink, None), (infer.prune, "magnitude"), (infer.quantize, "rtn"))  # in order, each its plain method


def reads(step: dict | None, plain: str | None) -> bool:
    """Whether a step (its keyword arguments) reads calibration: any but its `plain` method (shrink: always)."""
    return bool(step) and step.get("method") != plain


def compress(model, calibration, shrink: dict, prune: dict | None, quantize: dict | None):
    """The model after infer.shrink(**shrink), infer.prune(**prune) and infer.quantize(**quantize), each
    skipped when empty or None; `calibration` (token ids) goes to the methods that read it."""
    for (method, plain), step in zip(STEPS, (shrink, prune, quantize)):
        if step:
            model = method(model, **step, calibration=calibration if reads(step, plain) else None)
    return model


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.compress", description="Write a compressed copy of a run.")
    p.add_argument("run_dir", help="the run folder to compress (its latest checkpoint)")
    p.add_argument("--out", required=True, help="the new run folder (must not hold checkpoints)")
    p.add_argument("--shrink", nargs="+", default=[], metavar="PART=SHARE",
                   help="structured pruning: heads=, channels=, experts=, state= the share of each layer's to remove")
    p.add_argument("--prune", choices=("magnitude", "wanda", "sparsegpt"), help="unstructured or n:m pruning")
    p.add_argument("--sparsity", type=float, default=None, help="--prune's share of each column's weights")
    p.add_argument("--n-of-m", default=None, help="--prune's pattern instead, e.g. 2:4")
    p.add_argument("--quantize", choices=("int8", "int4", "int3"), help="the weights' bits")
    p.add_argument("--method", choices=METHODS, default="rtn", help="--quantize's (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=32, help="int4/int3 rows per scale (default: %(default)s)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize rows by decreasing Hessian diagonal")
    p.add_argument("--activations", choices=("int8", "float"), default="int8",
                   help="the product the quantized weights take (default: %(default)s)")
    p.add_argument("--head", choices=("int8", "float"), default=None,
                   help="keep the LM head (or tied embedding) at int8 or float while the rest takes --quantize")
    p.add_argument("--kv-cache", choices=("int8",), default=None, help="keep the attention KV cache in int8")
    p.add_argument("--calibration", type=int, default=32,
                   help="training windows to calibrate on (default: %(default)s)")
    return p


def options(args) -> tuple[dict, dict | None, dict | None]:
    """(shrink, prune, quantize) keyword arguments from the command line; errors name a bad flag."""
    shrink = {}
    for item in args.shrink:
        part, _, share = item.partition("=")
        if part not in ("heads", "channels", "experts", "state") or not share:
            raise ValueError(f"--shrink {item}: expected heads=, channels=, experts= or state= a share, "
                             "e.g. heads=0.25")
        try:
            shrink[part] = float(share)
        except ValueError:
            raise ValueError(f"--shrink {item}: {share!r} is not a number") from None
    prune = None
    if args.prune:
        if (args.sparsity is None) == (args.n_of_m is None):
            raise ValueError(f"--prune {args.prune}: give --sparsity or --n-of-m (one of them)")
        n_of_m = None
        if args.n_of_m:
            try:
                n_of_m = tuple(int(x) for x in args.n_of_m.split(":"))
            except ValueError:
                n_of_m = ()
            if len(n_of_m) != 2:
                raise ValueError(f"--n-of-m {args.n_of_m}: expected N:M, e.g. 2:4")
        prune = dict(method=args.prune, sparsity=args.sparsity, n_of_m=n_of_m)
    elif args.sparsity is not None or args.n_of_m:
        raise ValueError("--sparsity and --n-of-m are --prune's: name a method, e.g. --prune sparsegpt")
    quantize = None
    if args.quantize:
        quantize = dict(weights=args.quantize, kv_cache=args.kv_cache, group_size=args.group_size,
                        activations=args.activations, method=args.method, act_order=args.act_order, head=args.head)
    elif args.kv_cache or args.head:
        raise ValueError("--kv-cache and --head go with --quantize (python -m infer --kv-cache int8 decodes any run "
                         "with an int8 cache)")
    if not (shrink or prune or quantize):
        raise ValueError("nothing to do: give --shrink, --prune or --quantize")
    return shrink, prune, quantize


def main(argv=None):
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        shrink, prune, quantize = options(args)
        if (out / "checkpoints").exists():
            raise ValueError(f"--out {out} already holds checkpoints; name a new folder")
        cfg, model, step = checkpoint.load_model(args.run_dir)
        model.eval()
        steps = (shrink, prune, quantize)
        calibration = calibration_tokens(cfg, args.calibration) \
            if any(reads(step, plain) for (_, plain), step in zip(STEPS, steps)) else None
        small = compress(model, calibration, *steps)
    except ValueError as e:
        sys.exit(f"error: {e}")
    train = dataclasses.replace(cfg.train, qat=None, run_dir=None)  # a fine-tune names its own folder
    data = to_dict(dataclasses.replace(cfg, model=small.cfg, train=train))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    if (Path(args.run_dir) / "tokenizer.json").is_file():
        shutil.copyfile(Path(args.run_dir) / "tokenizer.json", out / "tokenizer.json")
    _, params, rest = nnx.split(small, nnx.Param, ...)
    items = {"params": nnx.to_pure_dict(params), "rest": nnx.to_pure_dict(rest)}
    if not jax.tree.leaves(items["rest"]):
        del items["rest"]
    meta = {"step": step, "config": data, "compressed_from": str(args.run_dir)}
    if quantize:
        meta["quantized"] = {k: quantize.get(k) for k in ("weights", "method", "group_size", "activations", "kv_cache",
                                                          "head")}
    checkpoint.save(checkpoint.manager(out / "checkpoints"), step, items, meta)
    print(f"{args.run_dir} (step {step}): {weight_bytes(model):,} bytes of weights -> {out}: {weight_bytes(small):,}")


if __name__ == "__main__":
    main()
