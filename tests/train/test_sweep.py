"""The sweep runner (train/sweep.py): a killed sweep resumed gives the table of an uninterrupted one
(and one run again reuses its finished cells, saying so), best learning rate per cell, width matching,
and bad grids refused before anything runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from train import sweep

ROOT = Path(__file__).resolve().parents[2]
GRID = {
    "base": {"model": {"num_layers": 1, "tie_embeddings": False},
             "data": {"task": {"kind": "mqar", "vocab_size": 32, "num_train_examples": 128, "num_test_examples": 16}},
             "train": {"steps": 40, "batch_size": 8, "warmup_steps": 2, "eval_every": 40, "log_every": 4,
                       "checkpoint_every": 4, "sample_tokens": 0}},
    "mixers": {"attention": {"kind": "attention", "num_heads": 1}},
    "d_model": [16], "seq_len": {16: {"data.task.num_kv_pairs": 2}}, "lr": [3e-3],
}


def _write(tmp_path, grid=GRID) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


def _results(out: Path):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows], (out / "table.md").read_text()


def test_a_killed_sweep_resumes_to_the_same_table(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path)
    sweep.sweep(sweep.load_grid(path), tmp_path / "whole", log=lambda *a: None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "train.sweep", str(path), "--out", str(tmp_path / "killed")],
                            env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first = tmp_path / "killed" / "cells" / "attention-d16-L16-lr0.003-s0" / "checkpoints"
    deadline = time.time() + 120
    while not (first.exists() and any(p.name.isdigit() for p in first.iterdir())) and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-cell: the first cell has a checkpoint, not its end
    proc.wait()
    assert sweep._finished(first.parent, 40) is None  # killed mid-cell
    sweep.sweep(sweep.load_grid(path), tmp_path / "killed", log=lambda *a: None)
    assert _results(tmp_path / "killed") == _results(tmp_path / "whole")
    assert (tmp_path / "whole" / "accuracy.png").exists()
    log = first.parent / "train.log"
    before = log.stat().st_mtime_ns
    said = []
    sweep.sweep(sweep.load_grid(path), tmp_path / "killed", log=said.append)  # finished: nothing runs
    assert log.stat().st_mtime_ns == before and _results(tmp_path / "killed") == _results(tmp_path / "whole")
    assert said[1].startswith("  [1/1] attention-d16-L16-lr0.003-s0: accuracy") and said[1].endswith("(reused)")


def test_best_learning_rate_per_cell_and_the_table():
    row = lambda lr, seed, acc: {"mixer": "gla", "d_model": 64, "seq_len": 32, "lr": lr, "seed": seed, "width": 64,
                                 "params": 1, "state_bytes": 2, "val_accuracy": acc, "val_loss": 1.0,
                                 "steps": 40 - seed}
    rows = [row(1e-3, 0, 0.9), row(1e-3, 1, 0.5), row(3e-3, 0, 0.8), row(3e-3, 1, 0.8)]
    (best,) = sweep.best_lr(rows)
    assert best["lr"] == 3e-3 and best["val_accuracy"] == 0.8 and best["seeds"] == 2  # the mean decides
    assert sweep.table([best]).startswith("| mixer | L=32 d=64 |\n|---|---|\n| gla | 0.800 |\n")
    assert "| gla | 32 | 64 | 64 | 1 | 2 | 40 |" in sweep.table([best])  # the most steps of its seeds


def test_widths_matched_by_parameters():
    grid = {**GRID, "mixers": {**GRID["mixers"], "gla": {"kind": "gla", "num_heads": 1}},
            "match": {"by": "params", "reference": "attention"}, "d_model": [32, 64], "seeds": [0]}
    cells = sweep.cells(grid)
    for d in (32, 64):
        ref = next(c for c in cells if c.mixer == "attention" and c.d_model == d)
        gla = next(c for c in cells if c.mixer == "gla" and c.d_model == d)
        p_ref, p_gla = sweep.sizes(ref.config)[0], sweep.sizes(gla.config)[0]
        step = abs(sweep.sizes({**gla.config, "model": {**gla.config["model"],
                                                        "d_model": gla.config["model"]["d_model"] + 16}})[0] - p_gla)
        assert abs(p_gla - p_ref) <= step  # the closest width on the 16-grid


def test_sizes_of_every_kind_at_the_default_cell():
    """Every registered kind's parameters and decode-state bytes, from shapes alone (a state computed from
    the parameters, as Hyena's filter taps, included); attention's as the MQAR table of docs/experiments.md gives."""
    grid = sweep.load_grid(sweep.DEFAULT)
    got = {name: sweep.sizes(sweep._config(grid, mixer, 64, 32, 1e-3, 0)) for name, mixer in grid["mixers"].items()}
    assert got["attention"] == (41_152, 33_048)
    assert all(params > 0 and state > 0 for params, state in got.values()), got


def test_bad_grids_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['widths'\\]"):
        sweep.load_grid(_write(tmp_path, {**GRID, "widths": [1]}))
    with pytest.raises(ValueError, match="match: expected \\{by: params or state, reference: one of attention"):
        sweep.load_grid(_write(tmp_path, {**GRID, "match": {"by": "flops", "reference": "attention"}}))
    bad = {**GRID, "mixers": {"attention": {"kind": "attention", "num_heads": 3}}}
    with pytest.raises(ValueError, match="sweep cell attention d_model=16 seq_len=16: .*num_heads: 3 does not divide"):
        sweep.cells(sweep.load_grid(_write(tmp_path, bad)))
    assert not (tmp_path / "runs").exists()
