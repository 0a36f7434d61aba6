"""Softmax attention split over a mesh's context axis (kernels.context.split_queries, contiguous and zigzag)
equals the call on one device, outputs and gradients, for every case of tests/kernels/context_attention_check.py
(GQA, packed documents, static and traced bands, FoX's decay, the blocked XLA form, and the layers Attention,
ForgettingAttention and MultiHeadLatentAttention) on the meshes context=8 and data=2 x context=4. The check runs
in a subprocess with 8 simulated CPU devices, so that this process keeps one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.context_attention_check import CASES, MESHES

ROOT = Path(__file__).parents[2]
TOL = 1e-5  # max |difference| / max |value| over the outputs and gradients, float32


@pytest.fixture(scope="module")
def errors():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # with conftest.py's fast-compile XLA_FLAGS
    out = subprocess.run([sys.executable, str(ROOT / "tests/kernels/context_attention_check.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_attention_equals_one_device(errors, case):
    got = errors[case]
    assert {(split, mesh) for split in got for mesh in got[split]} == \
        {(split, mesh) for split in ("contiguous", "zigzag") for mesh in MESHES}
    bad = {f"{split} on {mesh}": e for split in got for mesh, e in got[split].items() if not e < TOL}
    assert not bad, f"{case}: relative errors >= {TOL}: {bad}"
