"""The benchmark scripts run end to end at toy sizes (their figures are measured by hand: docs/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import serve


def test_serve_runs(tmp_path, monkeypatch):
    """benchmarks/serve.py on one sliding-window attention layer (a ring cache, rolled back after a short chunk):
    every table and file comes out, and the prefix cache reuses the shared prefix's blocks."""
    monkeypatch.chdir(tmp_path)
    out = serve.main("--kinds sinks_window --layers 1 --d-model 32 --requests 5 --rates 100 --prompt-len 3 9 "
                     "--output-len 2 5 --prefixes 1 --prefix-len 8 --suffix-len 1 4 --chunk 4 --contexts 128 "
                     "--breakdown --plot plot.png".split())
    assert [(r["server"], r["rate"]) for r in out["load"]] == [("engine", 100), ("static", 100)]
    assert all(r["tok/s"] > 0 and r["req/s"] > 0 for r in out["load"])
    assert out["memory"][0]["slots in 1 GiB at 128"] > 0
    off, on = out["prefix"]
    assert off["reused tokens"] == 0 < on["reused tokens"]
    assert off["prefill tokens"] == on["prefill tokens"] + on["reused tokens"]
    assert all(v > 0 for k, v in out["breakdown"][0].items() if k != "kind")
    assert {p.name for p in (tmp_path / "runs/bench").iterdir()} == {
        "serve_load.json", "serve_memory.json", "serve_prefix.json", "serve_breakdown.json"}
    assert (tmp_path / "plot.png").is_file()


def test_context_runs(tmp_path):
    """benchmarks/context.py on one GLA layer, as a script (its 8 simulated devices need a fresh process): every
    table comes out, the compiled step's exchange is the analytic one, and the context axis keeps less per
    device and trains a longer sequence in the same budget."""
    argv = "--kinds gla --d-model 32 --layers 1 --seq-len 256 --budget-mb 8 --search gla --time gla --steps 1"
    out = subprocess.run([sys.executable, "-m", "benchmarks.context", *argv.split()], cwd=tmp_path, text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    tables = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "runs/bench").iterdir()}
    assert set(tables) == {"context_exchange", "context_memory", "context_longest", "context_time"}
    (exchange,), (memory,), (longest,) = (tables[f"context_{t}"] for t in ("exchange", "memory", "longest"))
    assert exchange["exchanged (per device)"] == "state 1x4x4x1+1x4x4x8"  # GLA: M (B, H, K, 1), S_loc (B, H, K, V)
    analytic = round((8 + 1) * 4 * 4 * (1 + 8) * 4 / 1024, 2)  # n in the all-gather, one in its transpose
    assert exchange["exchange KiB/layer"] == exchange["analytic KiB/layer"] == analytic
    assert memory["temp MiB context=8"] < memory["temp MiB one"]
    assert longest["longest T context=8"] > longest["longest T one"] > 0
    assert tables["context_time"][0]["ms/step context=8"] > 0


def test_xla_profile_splits_a_train_step():
    """benchmarks/xla_profile.py on a one-layer attention model's train step (benchmarks/peers.py builds it): every
    category is there, the products, both attention passes and the optimiser take time, the busy time is within the
    wall time, and the places name the project's files."""
    from benchmarks import peers, xla_profile

    model = {"d_model": 32, "num_layers": 1, "mixer": {"kind": "attention", "num_heads": 2}}
    run, _, flops, hlo = peers.zoo_train(model, 2, 160)  # 160 tokens: the blocked attention form, 2 x 2 blocks
    shares = xla_profile.breakdown(run, hlo(), calls=2)
    assert set(xla_profile.CATEGORIES) | {"wall", "busy", "places"} == set(shares)
    assert all(shares[c] > 0 for c in ("products", "attention fwd", "attention bwd", "optimiser", "fusions"))
    assert 0 < shares["busy"] <= shares["wall"] and flops > 0
    assert any(place.startswith("layers/linear.py:") for (place, _, _), _ in shares["places"])
