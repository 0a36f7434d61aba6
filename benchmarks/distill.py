"""The table of docs/distillation.md: Transformer teachers converted into GLA, Gated DeltaNet and Mamba-2
students and into Gated DeltaNet hybrids keeping a quarter of their attention layers (at least one;
KL-guided and uniform), against the same architectures trained from scratch.

    python -m benchmarks.distill [--out runs/distill] [--align 0.02] [--distill 0.03]
                                 [--parts distill scratch full table decode] [--tasks text mqar]

Two teachers, each converted the same way: `text` (configs/distill/teacher.yaml: Shakespeare with a
BPE vocabulary) for validation bits per byte and decode cost, and `mqar` (configs/distill/recall.yaml:
Zoology's multi-query associative recall) for recall, which a text teacher of this size does not learn.
Each student: every converted layer started from the teacher (train/convert.py), `--align` x the
teacher's steps of attention transfer (stage layers), then `--distill` x its steps of end-to-end KL
(stage logits, start_from the first), at the teacher's batch and length. The hybrids convert the layers
`python -m train.hybrid` does not keep, run on the all-converted Gated DeltaNet student (`hybrid-kl`),
or keep every fourth layer (the last of each four; of two, the second: `hybrid-uniform`). From scratch:
the student's own model section trained on the student's token budget (`-scratch`) and on the teacher's
whole budget (`-full`, the teacher's own training section). Runs are trained when missing, resumed when
stopped, read when finished; each part can run alone. The table: the text run's last validation bits
per byte, the mqar run's last held-out accuracy, and (part `decode`, on a quiet machine) the text
model's decode ms/token and state MiB at `--context` (benchmarks/decode.py's measure).
"""

import argparse
import json
from pathlib import Path

import yaml

from benchmarks import decode
from benchmarks.common import print_table, save_json
from train.hybrid import main as choose_layers
from train.loop import run
from zoo import load_config
from zoo.checkpoint import load_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "distill"
TEACHERS = {"text": CONFIGS / "teacher.yaml", "mqar": CONFIGS / "recall.yaml"}
# each student kind at the width where every attention projection maps (docs/distillation.md's table)
KINDS = {"gla": {"kind": "gla", "num_heads": 4, "expand_k": 1},
         "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 4, "expand_v": 1},
         "mamba2": {"kind": "mamba2", "expand": 1, "head_dim": 32, "state_size": 32, "num_groups": 4}}
HYBRID = "gated_deltanet"  # the hybrids' converted layers
STUDENTS = [*KINDS, "hybrid-kl", "hybrid-uniform"]
PARTS = ["distill", "scratch", "full", "table", "decode"]


class Bench:
    """The runs of one teacher, in out/<task>: teacher, <student>-align, <student>, <student>-scratch,
    <student>-full, each with its config in out/<task>/configs."""

    def __init__(self, out: Path, task: str, align: float, distill: float):
        self.out, self.base = out / task, yaml.safe_load(TEACHERS[task].read_text())
        self.steps = self.base["train"]["steps"]
        self.align, self.distill = max(1, round(align * self.steps)), max(1, round(distill * self.steps))
        (self.out / "configs").mkdir(parents=True, exist_ok=True)

    def train(self, name: str, config: dict) -> Path:
        """Run `name` of `config` (written to configs/name.yaml): trained, resumed or read."""
        path = self.out / "configs" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"== {self.out.name}/{name}", flush=True)
        run(load_config(path), self.out / name, log=lambda line: print(f"   {line}", flush=True))
        return self.out / name

    def schedule(self, steps: int, **distill) -> dict:
        """The teacher's data and training section, shortened to `steps` steps."""
        train = {**self.base["train"], "steps": steps, "warmup_steps": max(1, steps // 10), "eval_every": steps,
                 "checkpoint_every": steps, "log_every": max(1, steps // 10)}
        return {"data": self.base["data"], "train": {**train, "distill": distill} if distill else train}

    def student(self, name: str, teacher: str, mixer: dict, layers=None) -> Path:
        """Attention transfer, then the KL, from the weights of the run `teacher`: run `name`."""
        convert = {"mixer": mixer, "layers": layers}
        aligned = self.train(f"{name}-align", self.schedule(self.align, teacher=teacher, convert=convert,
                                                            trainable="converted", stage="layers"))
        return self.train(name, self.schedule(self.distill, teacher=teacher, convert=convert, start_from=str(aligned)))

    def students(self):
        teacher = str(self.train("teacher", self.base))  # trained once, or read
        for kind, mixer in KINDS.items():
            self.student(kind, teacher, mixer)
        n, full = self.base["model"]["num_layers"], self.out / HYBRID
        keep = max(1, n // 4)
        if not (full / "hybrid.json").exists():
            choose_layers([str(full), "--keep", str(keep)])
        kl_layers = json.loads((full / "hybrid.json").read_text())["convert_layers"]
        self.student("hybrid-kl", teacher, KINDS[HYBRID], kl_layers)
        self.student("hybrid-uniform", teacher, KINDS[HYBRID], [i for i in range(n) if (i + 1) % (n // keep)])

    def scratch(self, name: str, full: bool):
        """The model of run `name` trained from scratch: on the student's budget, or the teacher's whole."""
        config = dict(self.base) if full else self.schedule(self.align + self.distill)
        config["model"] = yaml.safe_load((self.out / name / "config.yaml").read_text())["model"]
        self.train(f"{name}-{'full' if full else 'scratch'}", config)

    def last(self, name: str, key: str) -> float | None:
        """The run's last logged `key` (None: no such run yet)."""
        path = self.out / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        values = [r[key] for r in rows if key in r]
        return round(values[-1], 4) if values else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/distill"))
    p.add_argument("--align", type=float, default=0.02, help="attention transfer steps, a fraction of the teacher's")
    p.add_argument("--distill", type=float, default=0.03, help="end-to-end KL steps, a fraction of the teacher's")
    p.add_argument("--context", type=int, default=4096, help="the decode part's context")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    p.add_argument("--tasks", nargs="+", default=list(TEACHERS), choices=list(TEACHERS))
    args = p.parse_args()
    benches = {task: Bench(args.out, task, args.align, args.distill) for task in TEACHERS}
    for task in args.tasks:
        bench = benches[task]
        if "distill" in args.parts:
            bench.students()
        for part in ("scratch", "full"):
            for name in STUDENTS if part in args.parts else []:
                bench.scratch(name, full=part == "full")
    if {"table", "decode"} & set(args.parts):
        text, mqar = benches["text"], benches["mqar"]
        rows, tokens = [], text.base["train"]["batch_size"] * text.base["train"]["seq_len"]
        for name in ["teacher"] + [f"{s}{suffix}" for s in STUDENTS for suffix in ("", "-scratch", "-full")]:
            budget = text.steps if name == "teacher" or name.endswith("-full") else text.align + text.distill
            row = {"run": name, "budget": round(budget / text.steps, 3), "text_tokens": budget * tokens,
                   "val_bpb": text.last(name, "val_bpb"), "mqar_accuracy": mqar.last(name, "val_accuracy")}
            if "decode" in args.parts and (text.out / name / "checkpoints").is_dir():
                timed = decode.measure_model(load_model(text.out / name)[1], [args.context], repeats=5)[0]
                row |= {"decode_ms": timed["ms_per_token"], "state_MiB": timed["state_MiB"]}
            rows.append(row)
        print_table(rows, list(rows[0]))
        save_json("distill", rows)


if __name__ == "__main__":
    main()
