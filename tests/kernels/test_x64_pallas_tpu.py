"""The TPU Pallas kernels (the pallas_tpu.py files, Mosaic TPU) of every op under jax_enable_x64,
in the TPU interpreter: forward and gradient run, are finite, keep their dtypes and equal the same
call without x64, and no value inside a kernel or its index maps is 64-bit (Mosaic has no 64-bit
types; test_x64.py also lowers the kernels to Mosaic under x64). Inputs, calls and checks are
test_x64.py's.
"""

import pytest

from tests.kernels.test_x64 import OPS, check_kernels_under_x64


@pytest.mark.parametrize("op", OPS)
def test_kernels_under_x64_equal_kernels_without(op, monkeypatch):
    check_kernels_under_x64(op, "tpu", monkeypatch)
