"""The context-parallel forms of the ops whose state decays elementwise (context.split_diagonal: selective_scan,
rglru, s4d) against the ops on one device: tests/kernels/context_ssm_check.py in a subprocess (it needs 8 simulated
devices, this process keeps one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_split_diagonal_ops_match_one_device():
    out = subprocess.run([sys.executable, str(ROOT / "tests/kernels/context_ssm_check.py")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == {"selective_scan", "rglru", "s4d", "s4d fft"}
    for op, by_mesh in errors.items():
        assert by_mesh.pop("one device")["calls"] == 0, op  # one device runs the op whole
        assert set(by_mesh) == {"context=8", "data=2 context=4"}
        for mesh, e in by_mesh.items():
            assert e.pop("calls") == 1, (op, mesh)  # the split form ran
            assert all(v < 1e-5 for v in e.values()) and set(e) == {"y", "state", "grad"}, (op, mesh, e)
