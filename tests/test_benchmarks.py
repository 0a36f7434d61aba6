"""The benchmark scripts run end to end at toy sizes (their figures are measured by hand: docs/)."""

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
