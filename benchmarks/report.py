"""The report card: every registered mixer kind on cost, loss, recall and extrapolation, one table.

    python -m benchmarks.report [--kinds attention gla ...] [--steps 250] [--contexts 256 16384]
                                [--parts text lm_eval decode mqar needle serve] [--serve-rate 64]

Per kind, on this machine:
- parameters and training tokens/s of the equal-budget run: the kind's config in configs/
  (configs/<kind>.yaml, transformer.yaml for attention; a kind without one takes transformer.yaml
  with its mixer swapped in), `--steps` steps on Shakespeare, in runs/report/<kind>; its validation
  loss (nats/byte);
- the extrapolation ratio of that run: loss of the last 128 positions at 16x the training length
  over the loss at 1x (train/extrapolate.py; above 1: worse past the trained length);
- decode ms/token at each of `--contexts` and the decode-state MiB at the last (benchmarks/decode.py's
  model: width 256, 4 layers; attention as MHA);
- MQAR accuracy at the default sweep cell (configs/sweeps/mqar.yaml: length 32, 4 pairs), best
  learning rate, at each width; the sweep's cells of the kinds asked for are run (or resumed, or read
  when finished) in runs/sweep-mqar;
- needle accuracy at 1x, 4x and 16x the trained length (train/needle.py: exact match, the mean over
  depths 0, 0.25, 0.5, 0.75, 1) of the kind trained on the single needle (`needle`: a one-token word
  value, vocabulary 32) at 64 tokens: 2 layers of width 128, untied embeddings, up to 400 steps of 32
  examples at lr 3e-3, stopped at 0.99 held-out accuracy, in runs/report/needle-<kind>;
- the equal-budget run scored by lm-eval (train/harness.py) on the local tasks (train/lm_eval_tasks):
  multiple-choice accuracy (24 questions on The Tempest) and bits per byte of its rolling perplexity
  (empty where a task's requests are longer than the model takes: the reason goes to stderr);
- serving under load (benchmarks/serve.py: width 256, 4 layers, 48 requests at --serve-rate Poisson
  arrivals, 8 slots): generated tokens/s and TTFT p50 of infer.Engine and of static batches of generate,
  and the sequences whose decode state fits 1 GiB at 32K tokens.
Written to runs/report/report_card.md and .json; the report card table in docs/experiments.md is this output.
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import yaml
from flax import nnx

from benchmarks import decode, serve
from benchmarks.common import save_json
from train import needle, sweep
from train.extrapolate import extrapolate
from train.loop import run
from zoo import load_config
from zoo.checkpoint import load_model
from zoo.config import from_dict
from zoo.registry import MIXERS

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PARTS = ["text", "lm_eval", "decode", "mqar", "needle", "serve"]  # the column groups, each measurable alone


def kind_config(kind: str) -> tuple[Path, list[str]]:
    """(config file, overrides) of a kind's equal-budget run: configs/<kind>.yaml (transformer.yaml for
    attention), else the first config with that mixer, else transformer.yaml with the mixer swapped."""
    own = CONFIGS / ("transformer.yaml" if kind == "attention" else f"{kind}.yaml")
    for path in [own] * own.exists() + sorted(CONFIGS.glob("*.yaml")):
        mixer = (yaml.safe_load(path.read_text()).get("model") or {}).get("mixer") or {}
        if mixer.get("kind") == kind:
            return path, []
    return CONFIGS / "transformer.yaml", [f"model.mixer={json.dumps({'kind': kind})}"]


def equal_budget_run(kind: str, steps: int, out: Path, extra: tuple[str, ...] = (), name: str | None = None,
                     allow_config_change: bool = False) -> tuple[Path, dict]:
    """(run folder out/<name or kind>, its last metrics row) of the kind's equal-budget run: `steps` steps of
    its config (kind_config) with `extra` overrides; trained when missing, resumed when stopped, read when
    finished (a finished run resumed under more steps or another config with `allow_config_change`)."""
    path, over = kind_config(kind)
    cfg = load_config(path, over + [f"train.steps={steps}", f"train.eval_every={steps}", "train.sample_tokens=0",
                                    f"train.checkpoint_every={steps}", "train.log_every=50", *extra])
    run_dir = out / (name or kind)
    return run_dir, run(cfg, run_dir, log=lambda _: None, allow_config_change=allow_config_change)


def text_row(kind: str, steps: int, out: Path, lm_eval: bool = True) -> dict:
    run_dir, last = equal_budget_run(kind, steps, out)
    if "val_loss" not in last:
        last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    cfg, model, _ = load_model(run_dir)
    rows = extrapolate(model, cfg, (1, 16), batches=2)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"config": kind_config(kind)[0].stem, "params": params, "val_loss": round(last["val_loss"], 4),
            "train_tok_per_s": last.get("tokens_per_s"), "extrapolation_16x": rows[-1]["ratio"],
            **(harness_row(run_dir) if lm_eval else {})}


def harness_row(run_dir: Path) -> dict:
    """A run scored by lm-eval on the local tasks: multiple-choice accuracy, rolling bits per byte."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from train.harness import TASKS, ZooLM

    tasks, model = TaskManager(include_path=str(TASKS), include_defaults=False), ZooLM(path=str(run_dir), batch_size=16)

    def score(task: str, metric: str, digits: int) -> float | None:
        """The task's metric; None (the reason on stderr) when its requests are longer than the model takes."""
        try:
            out = lm_eval.simple_evaluate(model=model, task_manager=tasks, tasks=[task])["results"]
        except ValueError as e:  # the backend's length check, before any work
            print(f"{run_dir.name}: {task} not scored: {e}", file=sys.stderr)
            return None
        return round(out[task][metric], digits)

    return {"lm_eval_mc_acc": score("zoo_shakespeare_mc", "acc,none", 3),
            "lm_eval_ppl_bpb": score("zoo_shakespeare_ppl", "bits_per_byte,none", 4)}


def retrieval_row(kind: str, out: Path) -> dict:
    """Needle accuracy at 1x, 4x and 16x the trained 64 tokens, the mean over five depths (module docstring)."""
    cfg = from_dict({"model": {"d_model": 128, "num_layers": 2, "mixer": {"kind": kind}, "tie_embeddings": False},
                     "data": {"task": {"kind": "needle", "vocab_size": 32, "value": "word", "value_len": 1,
                                       "num_test_examples": 256}},
                     "train": {"steps": 400, "batch_size": 32, "seq_len": 64, "lr": 3e-3, "warmup_steps": 20,
                               "weight_decay": 0.0, "eval_every": 100, "log_every": 100, "checkpoint_every": 400,
                               "sample_tokens": 0, "stop_at_accuracy": 0.99}})
    run(cfg, out / f"needle-{kind}", log=lambda _: None)  # resumes, or reads a finished run
    cfg, model, _ = load_model(out / f"needle-{kind}")
    factors = (1, 4, 16)
    table = needle.evaluate(model, cfg, [f * cfg.train.seq_len for f in factors], [0, 0.25, 0.5, 0.75, 1])
    return {f"needle_{f}x": round(sum(row) / len(row), 3) for f, row in zip(factors, table["accuracy"])}


def serve_row(kind: str, rate: float) -> dict:
    """The kind under load (benchmarks/serve.py's model and workload, one rate): generated tokens/s and TTFT p50
    of the engine and of static batches of generate, and the sequences whose decode state fits 1 GiB at 32K."""
    args = serve.parser().parse_args(["--kinds", kind, "--rates", str(rate)])
    rows = serve.measure(kind, args, serve.workloads(args), prefix_cache=False)
    engine, static = ({**r, "ttft": r["TTFT ms p50/p90/p99"].split(" / ")[0]} for r in rows["load"])
    return {f"serve_tok_s_{rate:g}": engine["tok/s"], f"static_tok_s_{rate:g}": static["tok/s"],
            "serve_ttft_p50_ms": engine["ttft"], "static_ttft_p50_ms": static["ttft"],
            "slots_1GiB_32K": rows["memory"][0]["slots in 1 GiB at 32768"]}


def mqar_rows(kinds: list[str], workers: int) -> dict:
    grid = sweep.load_grid(sweep.DEFAULT)
    grid["mixers"] = {name: mixer for name, mixer in grid["mixers"].items() if name in kinds}
    best = sweep.best_lr(sweep.sweep(grid, Path("runs/sweep-mqar"), workers, log=lambda *a: None))
    return {(r["mixer"], r["d_model"]): r["val_accuracy"] for r in best}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(MIXERS), choices=list(MIXERS))
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 16384])
    p.add_argument("--workers", type=int, default=1, help="sweep cells at once")
    p.add_argument("--serve-rate", type=float, default=64, help="requests/s of the serve part (default: %(default)s)")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS,
                   help="the columns to measure (lm_eval scores the text run, so it needs text)")
    args = p.parse_args()
    if "lm_eval" in args.parts and "text" not in args.parts:
        p.error("--parts lm_eval scores the equal-budget text run: add text")
    out = Path("runs/report")
    mqar = mqar_rows(args.kinds, args.workers) if "mqar" in args.parts else {}
    widths = sorted({d for _, d in mqar})
    rows = []
    for kind in args.kinds:
        row = {"kind": kind}
        if "text" in args.parts:
            row.update(text_row(kind, args.steps, out, lm_eval="lm_eval" in args.parts))
        if "decode" in args.parts:
            timed = decode.measure(kind, args.contexts, repeats=5)
            for r in timed:
                row[f"decode_ms_{r['context']}"] = r["ms_per_token"]
            row[f"state_MiB_{args.contexts[-1]}"] = timed[-1]["state_MiB"]
        for d in widths:
            row[f"mqar_d{d}"] = mqar.get((kind, d))
        if "needle" in args.parts:
            row.update(retrieval_row(kind, out))
        if "serve" in args.parts:
            row.update(serve_row(kind, args.serve_rate))
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = list(rows[0])
    table = "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|\n" + "".join(
        "| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |\n" for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report_card.md").write_text(table)
    save_json("report", rows)
    print(table)


if __name__ == "__main__":
    main()
