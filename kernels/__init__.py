"""Pure array functions, one folder per op, layout [B, T, H, D]. No Flax here."""

import os

# The Pallas kernels pass their tests on CPU in interpret mode and lower for CUDA, but have not yet
# run on a GPU. Until a GPU run of `python -m benchmarks.kernels` verifies them, impl="auto" keeps to
# XLA unless ZOO_AUTO_PALLAS=1 is set; impl="pallas" always runs them.
AUTO_PALLAS = os.environ.get("ZOO_AUTO_PALLAS") == "1"
