"""Compression across kinds: the validation loss of each kind's trained model after each method of
infer/quantize.py, infer/prune.py and infer/factorize.py, next to the float model's.

    python -m benchmarks.compress [--kinds attention gla gated_deltanet mamba2 rwkv7] [--steps 250]
                                  [--calibration 16] [--batches 4] [--families factorization] [--qat 50]
                                  [--decode 4096] [--runs RUN_DIR ...] [--settings 'int4 gptq' ...] [--stats]

Per kind: the report card's equal-budget run (benchmarks/report.equal_budget_run: the kind's config, --steps
steps on Shakespeare, in runs/report/<kind>; trained when missing, read when finished), or with --runs the
given run folders (a BPE or a task run too); calibration token ids: --calibration training windows of the
run's length (train.compress.calibration_tokens: drawn away from the training steps' batches); the
validation loss in nats per byte (a BPE run's loss per token times its tokens per byte; a task run: its
held-out accuracy) over --batches x 8 validation windows (train/extrapolate.py at 1x: one full pass,
teacher-forced) of the float model and of each setting of SETTINGS (of --families, all by default;
"spread": ranks allocated by the spectra, infer.factorize's allocate="spectrum"; composition: pruning then
quantizing; structured: infer.shrink; n/a where the method refuses the kind, its reason printed). Prints
one table per method family: the loss of each setting and, beside it, its change from the float model's;
then the weights'
bytes at rest (int4 codes at half a byte, infer/quantize.weight_bytes) for quantization, factorization and
structured pruning (an unstructured pruned model stores its zeros: its bytes are the float model's), the
decode state's MiB after 4,096 tokens for structured pruning, and with --decode the decode ms/token of
each setting; writes runs/bench/compress.json and compress.png (a panel per family, a bar per kind).

--stats prints instead what the projections' inputs and weights look like on the calibration windows
(`statistics`: activation outlier ratios, weight max/rms) and the int4 cost of the mixers', the
FFNs' and the head's weights apart, the figures that explain which kinds bear rounding worst.

--qat N measures quantization-aware training instead: each kind's run copied twice (runs/report/<kind>-float+N,
<kind>-qat+N) and trained N steps further (its schedule stretched to --steps + N, the same in both), in
float and with train.qat as "int4 rtn" reads the weights (groups of 16, float activations); the table gives
each copy's validation loss in float and at int4 RTN (the QAT copy's is the loss it trained on), next to
the run's own.
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import infer
from benchmarks import decode
from benchmarks.common import print_table, save_json
from benchmarks.report import equal_budget_run
from infer.quantize import input_statistics, is_projection, matrices, weight_bytes
from train.compress import calibration_tokens
from train.extrapolate import extrapolate
from train.prepare import prepare
from zoo.checkpoint import load_model

# family -> setting -> (function, its arguments; "calibration" filled in). int4 and int3 in groups of 16
# input rows: 32 does not divide GLA's 16-wide gate projection.
INT4 = dict(group_size=16, activations="float")
QAT = (f"train.qat={json.dumps(dict(bits='int4', **INT4))}",)
REPORT = Path("runs/report")


def pruned_then_quantized(model, calibration, **prune):
    """SparseGPT pruning, then int4 GPTQ calibrated on the pruned model (which keeps its zeros)."""
    sparse = infer.prune(model, "sparsegpt", calibration=calibration, **prune)
    return infer.quantize(sparse, "int4", **INT4, calibration=calibration)


SETTINGS = {
    "quantization": {
        "int8 rtn": (infer.quantize, dict(weights="int8")),  # W8A8: int8 activations per token
        "int8 smoothquant": (infer.quantize, dict(weights="int8", method="smoothquant", calibration=True)),
        "int4 rtn": (infer.quantize, dict(weights="int4", **INT4)),
        "int4 awq": (infer.quantize, dict(weights="int4", **INT4, method="awq", calibration=True)),
        "int4 gptq": (infer.quantize, dict(weights="int4", **INT4, calibration=True)),
        "int3 gptq": (infer.quantize, dict(weights="int3", **INT4, calibration=True)),
        "int4 rtn, int8 head": (infer.quantize, dict(weights="int4", **INT4, head="int8")),
        "int4 gptq, int8 head": (infer.quantize, dict(weights="int4", **INT4, calibration=True, head="int8")),
    },
    "pruning": {
        "magnitude 50%": (infer.prune, dict(method="magnitude", sparsity=0.5)),
        "wanda 50%": (infer.prune, dict(method="wanda", sparsity=0.5, calibration=True)),
        "sparsegpt 50%": (infer.prune, dict(method="sparsegpt", sparsity=0.5, calibration=True)),
        "wanda 2:4": (infer.prune, dict(method="wanda", n_of_m=(2, 4), calibration=True)),
        "sparsegpt 2:4": (infer.prune, dict(method="sparsegpt", n_of_m=(2, 4), calibration=True)),
    },
    "factorization": {
        "svd 0.75": (infer.factorize, dict(rank_fraction=0.75)),
        "svd 0.5": (infer.factorize, dict(rank_fraction=0.5)),
        "svd-llm 0.75": (infer.factorize, dict(rank_fraction=0.75, calibration=True)),
        "svd-llm 0.5": (infer.factorize, dict(rank_fraction=0.5, calibration=True)),
        "svd-llm 0.75 spread": (infer.factorize, dict(rank_fraction=0.75, calibration=True, allocate="spectrum")),
        "svd-llm 0.5 spread": (infer.factorize, dict(rank_fraction=0.5, calibration=True, allocate="spectrum")),
    },
    "composition": {
        "sparsegpt 50% + int4 gptq": (pruned_then_quantized, dict(sparsity=0.5, calibration=True)),
        "sparsegpt 2:4 + int4 gptq": (pruned_then_quantized, dict(sparsity=None, n_of_m=(2, 4), calibration=True)),
    },
    "structured": {
        "heads 25%": (infer.shrink, dict(heads=0.25, calibration=True)),
        "heads 50%": (infer.shrink, dict(heads=0.5, calibration=True)),
        "channels 25%": (infer.shrink, dict(channels=0.25, calibration=True)),
        "channels 50%": (infer.shrink, dict(channels=0.5, calibration=True)),
        "state 25%": (infer.shrink, dict(state=0.25, calibration=True)),
        "state 50%": (infer.shrink, dict(state=0.5, calibration=True)),
    },
}


def val_loss(model, cfg, batches: int) -> float:
    """Validation loss (nats/byte; a BPE run's per token times its tokens per byte) over `batches` x 8 windows
    of the run's length, one full pass; a task run's held-out accuracy instead."""
    row = extrapolate(model, cfg, (1,), batches)[0]
    if cfg.data.task:
        return row["accuracy"]
    return round(row["loss_per_bucket"][0] * prepare(cfg.data).tokens_per_byte("val"), 4)


def state_mib(model, context: int = 4096) -> float:
    """The decode state's MiB after `context` tokens, batch 1 (shapes only): what removing heads or state
    channels also shrinks."""
    shapes = jax.eval_shape(lambda: model.init_state(1, context))
    return round(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) / 2 ** 20, 3)


def measure(kind: str, run_dir: Path, calibration: int, batches: int, families: list[str], context: int) -> dict:
    """{setting: validation loss (or accuracy)} of the run's model, float and compressed by the settings of
    `families` (None where the method refuses the kind, e.g. a unit it lacks), with each one's bytes and
    (`context` > 0) decode ms/token after `context` tokens."""
    cfg, model, _ = load_model(run_dir)
    tokens = calibration_tokens(cfg, calibration)
    ms = lambda m: decode.measure_model(m, [context], repeats=5)[0]["ms_per_token"] if context else None
    row = {"kind": kind, "float": val_loss(model, cfg, batches), "bytes": {"float": weight_bytes(model)},
           "decode_ms": {"float": ms(model)}, "state_mib": {"float": state_mib(model)}}
    for family in families:
        for name, (method, kwargs) in SETTINGS[family].items():
            kwargs = {k: (tokens if k == "calibration" else v) for k, v in kwargs.items()}
            t = time.perf_counter()
            try:
                compressed = method(model, **kwargs)
            except ValueError as e:  # a unit the kind lacks, a group size its widths refuse: n/a, said why
                print(f"{kind} {name}: n/a ({e})", flush=True)
                row[name] = row["bytes"][name] = row["decode_ms"][name] = row["state_mib"][name] = None
                continue
            row[name], row["bytes"][name] = val_loss(compressed, cfg, batches), weight_bytes(compressed)
            row["state_mib"][name] = state_mib(compressed)
            row["decode_ms"][name] = ms(compressed)
            print(f"{kind} {name}: {row[name]} ({time.perf_counter() - t:.1f} s)", flush=True)
    return row


def statistics(kind: str, run_dir: Path, calibration: int, batches: int) -> dict:
    """What the projections' inputs and weights look like on the calibration windows: per projection, the
    activation outlier ratio (the largest input channel's max |x| over the median channel's: what per-token
    int8 activations and AWQ/SmoothQuant's scales face) and the weight outlier ratio (max |w| over the rms,
    per column: what a rounding step sized by the largest weight costs the rest); the median over the
    projections and the largest, with its projection. Then where int4 rounding costs: the validation loss
    change with only the mixers', only the FFNs' or only the head's weights rounded to nearest (int4, groups
    of 16)."""
    cfg, model, _ = load_model(run_dir)
    rounded = infer.quantize(model, "int4", **INT4)
    float_loss, cost = val_loss(model, cfg, batches), {}
    for part in ("mixer", "ffn", "head"):
        mixed = nnx.clone(model)
        if part == "head":  # the LM head, or the tied embedding table it reads
            tied = model.head is None
            name = "embedding" if tied else "head"
            setattr(mixed.embed if tied else mixed, name, getattr(rounded.embed if tied else rounded, name))
        for b, q in zip(mixed.blocks, rounded.blocks) if part != "head" else ():
            setattr(b, part, getattr(q, part))
        cost[part] = round(val_loss(mixed, cfg, batches) - float_loss, 4)
    todo = [t for t in matrices(model) if is_projection(model, t)]
    stats = input_statistics(model, todo, calibration_tokens(cfg, calibration), who="statistics")
    paths = {id(m): ".".join(map(str, p)) for p, m in nnx.iter_modules(model)}
    acts, weights = {}, {}
    for i, (m, name, in_ndim, *_) in enumerate(todo):
        where = f"{paths[id(m)]}.{name}".removeprefix("blocks.")
        absmax = stats[i]["absmax"]
        acts[where] = float(absmax.max() / np.median(absmax))
        w = np.asarray(getattr(m, name).get_value()).reshape(int(np.prod(getattr(m, name).shape[:in_ndim])), -1)
        weights[where] = float(np.median(np.abs(w).max(0) / np.sqrt((w ** 2).mean(0))))
    worst = lambda d: f"{max(d.values()):.1f} ({max(d, key=d.get)})"
    return {"kind": kind, "activation outliers (median)": round(float(np.median(list(acts.values()))), 1),
            "activation outliers (largest)": worst(acts),
            "weight max/rms (median)": round(float(np.median(list(weights.values()))), 1),
            "weight max/rms (largest)": worst(weights), "int4 rtn: mixers only": cost["mixer"],
            "int4 rtn: ffns only": cost["ffn"], "int4 rtn: head only": cost["head"]}


def qat_row(kind: str, steps: int, more: int, batches: int) -> dict:
    """Validation losses (float, int4 RTN) of the kind's run and of its two copies trained `more` steps
    further, in float and with train.qat."""
    runs = {"run": equal_budget_run(kind, steps, REPORT)[0]}
    for arm, extra in (("float", ()), ("qat", QAT)):
        name = f"{kind}-{arm}+{more}"
        if not (REPORT / name).exists():
            shutil.copytree(runs["run"], REPORT / name)  # resumed from the run's last checkpoint
        runs[arm] = equal_budget_run(kind, steps + more, REPORT, extra, name, allow_config_change=True)[0]
    row = {"kind": kind}
    for arm, run_dir in runs.items():
        cfg, model, _ = load_model(run_dir)
        row[f"{arm} float"] = val_loss(model, cfg, batches)
        row[f"{arm} int4"] = val_loss(infer.quantize(model, "int4", **INT4), cfg, batches)
    return row


def plot(rows: list[dict], families: list[str], path: Path):
    """One panel per family: each setting's change from the float model, a bar per kind (n/a: none);
    skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plot")
        return
    cols = min(3, len(families))
    nrows = -(-len(families) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(families):]:
        ax.set_visible(False)
    for ax, family in zip(axes.flat, families):
        settings = list(SETTINGS[family])
        for k, r in enumerate(rows):
            x = np.arange(len(settings)) + (k - (len(rows) - 1) / 2) * 0.8 / len(rows)
            y = [np.nan if r[s] is None else r[s] - r["float"] for s in settings]
            ax.bar(x, y, width=0.8 / len(rows), label=r["kind"])
        ax.set_xticks(range(len(settings)), settings, rotation=40, ha="right", fontsize=8)
        ax.set_title(family, fontsize=10)
        ax.set_ylabel("change from float (nats/byte)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["attention", "gla", "gated_deltanet", "mamba2", "rwkv7"])
    p.add_argument("--runs", nargs="+", default=[], metavar="RUN_DIR",
                   help="measure these trained run folders (named by folder) instead of the kinds' report runs")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--calibration", type=int, default=16, help="calibration windows (default: %(default)s)")
    p.add_argument("--batches", type=int, default=4, help="validation batches of 8 windows (default: %(default)s)")
    p.add_argument("--families", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--settings", nargs="+", default=None, metavar="SETTING",
                   help="only these settings of the families, e.g. 'int4 gptq' 'sparsegpt 50%%' (default: all)")
    p.add_argument("--stats", action="store_true", help="print the projections' activation and weight outlier "
                   "statistics instead")
    p.add_argument("--qat", type=int, default=0, help="steps of the quantization-aware fine-tune (default: none)")
    p.add_argument("--decode", type=int, default=0, metavar="CONTEXT",
                   help="also time decoding (ms/token, batch 1) after CONTEXT tokens (default: not timed)")
    args = p.parse_args()
    if args.settings:
        unknown = set(args.settings) - {name for family in SETTINGS.values() for name in family}
        if unknown:
            p.error(f"--settings {', '.join(sorted(unknown))}: not settings of {list(SETTINGS)}")
        for family in SETTINGS:
            SETTINGS[family] = {k: v for k, v in SETTINGS[family].items() if k in args.settings}
        args.families = [f for f in args.families if SETTINGS[f]]
    runs = [(Path(r).name, Path(r)) for r in args.runs] or \
        [(k, equal_budget_run(k, args.steps, REPORT)[0]) for k in args.kinds]
    if args.stats:
        rows = [statistics(name, run_dir, args.calibration, args.batches) for name, run_dir in runs]
        print("\nactivation and weight statistics of the projections (benchmarks/compress.statistics)")
        print_table(rows, list(rows[0]))
        save_json("compress_stats", rows)
        return
    if args.qat:
        rows = [qat_row(k, args.steps, args.qat, args.batches) for k in args.kinds]
        print(f"\nquantization-aware training: validation loss (nats/byte) in float and at int4 RTN, of the "
              f"{args.steps}-step run and of it trained {args.qat} steps further in float and with train.qat")
        print_table(rows, list(rows[0]))
        save_json("compress_qat", rows)
        return
    rows = [measure(name, run_dir, args.calibration, args.batches, args.families, args.decode)
            for name, run_dir in runs]
    for family in args.families:
        settings = SETTINGS[family]
        print(f"\n{family}: validation loss (nats/byte; a task run: accuracy), and its change from the float model's")
        print_table([{"kind": r["kind"], "float": r["float"],
                      **{s: "n/a" if r[s] is None else f"{r[s]} ({r[s] - r['float']:+.3f})" for s in settings}}
                     for r in rows], ["kind", "float", *settings])
    for family in [f for f in ("quantization", "factorization", "structured") if f in args.families]:
        print(f"\n{family}: weight bytes at rest (MB)")
        settings = ["float", *SETTINGS[family]]
        print_table([{"kind": r["kind"], **{s: "n/a" if r["bytes"][s] is None else round(r["bytes"][s] / 1e6, 3)
                                                  for s in settings}} for r in rows],
                    ["kind", *settings])
    if "structured" in args.families:
        print("\nstructured: decode state MiB after 4,096 tokens (batch 1)")
        settings = ["float", *SETTINGS["structured"]]
        print_table([{"kind": r["kind"], **{s: "n/a" if r["state_mib"][s] is None else r["state_mib"][s]
                                            for s in settings}} for r in rows], ["kind", *settings])
    for family in args.families if args.decode else []:
        print(f"\n{family}: decode ms/token after {args.decode} tokens (batch 1, benchmarks/decode.py's measure)")
        settings = ["float", *SETTINGS[family]]
        print_table([{"kind": r["kind"], **r["decode_ms"]} for r in rows], ["kind", *settings])
    save_json("compress", rows)
    plot(rows, args.families, Path("runs/bench/compress.png"))


if __name__ == "__main__":
    main()
