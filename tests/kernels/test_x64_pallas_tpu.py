"""The TPU Pallas kernels (the pallas_tpu.py files, Mosaic TPU) under jax_enable_x64, in the TPU
interpreter: forward and gradient run, are finite, keep their dtypes and equal the same call without
x64, and no value inside a kernel or its index maps is 64-bit (Mosaic has no 64-bit types;
test_x64.py also lowers the kernels to Mosaic under x64). Inputs, calls and checks are test_x64.py's.
One op per kernel: retention, linear attention, SSD and WKV6 run GLA's kernels, behind the same
wrappers as on the GPU family (test_x64_pallas.py runs every op there).
"""

import pytest

from tests.kernels.test_x64 import OPS, check_kernels_under_x64


@pytest.mark.parametrize("op", [op for op in OPS if op not in ("retention", "linear_attention", "ssd", "wkv6")])
def test_kernels_under_x64_equal_kernels_without(op, monkeypatch):
    check_kernels_under_x64(op, "tpu", monkeypatch)
