"""Compression across kinds: the validation loss of each kind's trained model after each method of
infer/quantize.py, infer/prune.py and infer/factorize.py, next to the float model's.

    python -m benchmarks.compress [--kinds attention gla gated_deltanet mamba2 rwkv7] [--steps 250]
                                  [--calibration 16] [--batches 4] [--families factorization] [--qat 50]
                                  [--decode 4096]

Per kind: the report card's equal-budget run (benchmarks/report.equal_budget_run: the kind's config, --steps
steps on Shakespeare, in runs/report/<kind>; trained when missing, read when finished); calibration token
ids: --calibration training windows of the run's length (drawn away from the training steps' batches); the
validation loss in nats per byte over --batches x 8 validation windows (train/extrapolate.py at 1x: one full
pass, teacher-forced) of the float model and of each setting of SETTINGS (of --families, all by default;
"spread": ranks allocated by the spectra, infer.factorize's allocate="spectrum"; composition: pruning then
quantizing). Prints one table per method family (quantization, pruning, factorization, composition): the
loss of each setting and, beside it, its increase over the float model's; then the weights' bytes at rest
(int4 codes at half a byte, infer/quantize.weight_bytes) for quantization and factorization (a pruned model
stores its zeros: its bytes are the float model's), and with --decode the decode ms/token of each setting;
writes runs/bench/compress.json.

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

import infer
from benchmarks import decode
from benchmarks.common import print_table, save_json
from benchmarks.report import equal_budget_run
from infer.quantize import weight_bytes
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
}


def val_loss(model, cfg, batches: int) -> float:
    """Validation loss (nats/byte) over `batches` x 8 windows of the run's length, one full pass."""
    return round(extrapolate(model, cfg, (1,), batches)[0]["loss_per_bucket"][0], 4)


def measure(kind: str, run_dir: Path, calibration: int, batches: int, families: list[str], context: int) -> dict:
    """{setting: validation loss} of the run's model, float and compressed by the settings of `families`,
    with each one's bytes and (`context` > 0) decode ms/token after `context` tokens."""
    cfg, model, _ = load_model(run_dir)
    corpus = prepare(cfg.data).batches(cfg.train.seq_len, cfg.train.seed + 1, cfg.data.packing)
    tokens = corpus.train_batch(10**6, calibration)["x"]
    ms = lambda m: decode.measure_model(m, [context], repeats=5)[0]["ms_per_token"] if context else None
    row = {"kind": kind, "float": val_loss(model, cfg, batches), "bytes": {"float": weight_bytes(model)},
           "decode_ms": {"float": ms(model)}}
    for family in families:
        for name, (method, kwargs) in SETTINGS[family].items():
            kwargs = {k: (tokens if k == "calibration" else v) for k, v in kwargs.items()}
            t = time.perf_counter()
            compressed = method(model, **kwargs)
            row[name], row["bytes"][name] = val_loss(compressed, cfg, batches), weight_bytes(compressed)
            row["decode_ms"][name] = ms(compressed)
            print(f"{kind} {name}: {row[name]} ({time.perf_counter() - t:.1f} s)", flush=True)
    return row


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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=["attention", "gla", "gated_deltanet", "mamba2", "rwkv7"])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--calibration", type=int, default=16, help="calibration windows (default: %(default)s)")
    p.add_argument("--batches", type=int, default=4, help="validation batches of 8 windows (default: %(default)s)")
    p.add_argument("--families", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    p.add_argument("--qat", type=int, default=0, help="steps of the quantization-aware fine-tune (default: none)")
    p.add_argument("--decode", type=int, default=0, metavar="CONTEXT",
                   help="also time decoding (ms/token, batch 1) after CONTEXT tokens (default: not timed)")
    args = p.parse_args()
    if args.qat:
        rows = [qat_row(k, args.steps, args.qat, args.batches) for k in args.kinds]
        print(f"\nquantization-aware training: validation loss (nats/byte) in float and at int4 RTN, of the "
              f"{args.steps}-step run and of it trained {args.qat} steps further in float and with train.qat")
        print_table(rows, list(rows[0]))
        save_json("compress_qat", rows)
        return
    rows = [measure(k, equal_budget_run(k, args.steps, REPORT)[0], args.calibration, args.batches, args.families,
                    args.decode) for k in args.kinds]
    for family in args.families:
        settings = SETTINGS[family]
        print(f"\n{family}: validation loss (nats/byte), and its increase over the float model's")
        print_table([{"kind": r["kind"], "float": r["float"],
                      **{s: f"{r[s]} ({r[s] - r['float']:+.3f})" for s in settings}} for r in rows],
                    ["kind", "float", *settings])
    for family in [f for f in ("quantization", "factorization") if f in args.families]:
        print(f"\n{family}: weight bytes at rest (MB)")
        settings = ["float", *SETTINGS[family]]
        print_table([{"kind": r["kind"], **{s: round(r["bytes"][s] / 1e6, 3) for s in settings}} for r in rows],
                    ["kind", *settings])
    for family in args.families if args.decode else []:
        print(f"\n{family}: decode ms/token after {args.decode} tokens (batch 1, benchmarks/decode.py's measure)")
        settings = ["float", *SETTINGS[family]]
        print_table([{"kind": r["kind"], **r["decode_ms"]} for r in rows], ["kind", *settings])
    save_json("compress", rows)


if __name__ == "__main__":
    main()
