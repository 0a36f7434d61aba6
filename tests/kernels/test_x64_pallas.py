"""The GPU Pallas kernels (the pallas.py files, Triton) of every op under jax_enable_x64: forward and
gradient run, are finite, keep their dtypes and equal the same call without x64, and no value inside
a kernel or its index maps is 64-bit (a Python int meeting an int32 grid index, a loop counter of the
default int type, a float64 tile of constants). Inputs, calls and checks are test_x64.py's; on CPU
the kernels run in interpret mode.
"""

import pytest

from tests.kernels.test_x64 import OPS, check_kernels_under_x64


@pytest.mark.parametrize("op", OPS)
def test_kernels_under_x64_equal_kernels_without(op, monkeypatch):
    check_kernels_under_x64(op, "gpu", monkeypatch)
