"""Every op with a context-parallel form (kernels/context.py) gives the single-device op's outputs, end state
and gradients on 8 simulated devices, split context=8 and data=2 x context=4, with packed documents crossing the
devices' spans and an initial state (tests/kernels/context_check.py, in a subprocess so that this process keeps
one device). The models and a training run on the context axis: tests/train/test_sharding.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
OPS = ("linear_attention", "retention", "gla", "delta_rule", "gated_delta_rule", "kda", "delta_product", "ssd",
       "wkv6", "wkv7")


@pytest.fixture(scope="module")
def errors():
    done = subprocess.run([sys.executable, str(ROOT / "tests/kernels/context_check.py")], cwd=ROOT, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("op", OPS)
def test_context_parallel_op_equals_one_device(errors, op):
    for mesh, (err, forms) in errors[op].items():
        assert forms >= 1, (op, mesh)  # the context-parallel form ran
        assert err < 1e-5, (op, mesh, err)
