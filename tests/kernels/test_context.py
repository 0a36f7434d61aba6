"""Every op with a context-parallel form (kernels/context.py) gives the single-device call's outputs, end state and
gradients on 8 simulated devices, split context=8 and data=2 x context=4 (softmax attention with each split,
contiguous and zigzag), with packed documents crossing the devices' spans and, for the recurrent ops, an initial
state; and the form ran under each mesh and not on one device. tests/kernels/context_check.py runs every case once,
in a subprocess so that this process keeps one device. The models and a training run on the context axis:
tests/train/test_sharding_context.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.context import SPLITS
from tests.kernels.context_check import CASES, FORMS, MESHES

ROOT = Path(__file__).parents[2]
TOL = 1e-5  # max |difference| / max |value| of each array, float32


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # with conftest.py's fast-compile XLA_FLAGS
    done = subprocess.run([sys.executable, str(ROOT / "tests/kernels/context_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_form_equals_one_device(report, case):
    got = report[case]
    form = got["form"]
    assert got["one device"] == {f: [] for f in FORMS}, f"{case}: traced on one device {got['one device']}"
    splits = SPLITS if form == "split_queries" else (None,)
    runs = [(run["split"], run["mesh"]) for run in got["runs"]]
    assert runs == [(split, mesh) for split in splits for mesh in MESHES], f"{case}: ran {runs}"
    for run in got["runs"]:
        where = f"{case} on {run['mesh']}" + (f", {run['split']} split" if run["split"] else "")
        once = {f: [run["split"]] if f == form else [] for f in FORMS}  # the form's function once, with the split
        assert run["calls"] == once, f"{where}: traced {run['calls']}, expected {once}"
        expected = {"outputs", "gradients"} | ({"end state"} if form == "over_spans" else set())
        assert set(run["errors"]) == expected, f"{where}: compared {sorted(run['errors'])}, expected {expected}"
        bad = {what + name: e for what, arrays in run["errors"].items() for name, e in arrays.items() if not e < TOL}
        assert not bad, f"{where}: relative errors >= {TOL}: {bad}"
