"""Pure array functions, one folder per op, layout [B, T, H, D]. No Flax here."""

import os

import jax

IMPLS = ("auto", "reference", "xla", "pallas")

# The Pallas kernels pass their tests on CPU in interpret mode and lower for CUDA, but have not yet
# run on a GPU. Until a GPU run of `python -m benchmarks.kernels` verifies them, impl="auto" keeps to
# XLA unless ZOO_AUTO_PALLAS=1 is set; impl="pallas" always runs them.
AUTO_PALLAS = os.environ.get("ZOO_AUTO_PALLAS") == "1"


def check_impl(impl: str, where: str):
    """Refuse an unknown `impl`, and impl="pallas" on TPU (no TPU kernels yet), naming `where`."""
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl={impl!r}; expected one of {IMPLS}")
    if impl == "pallas" and jax.default_backend() == "tpu":
        raise ValueError(f"{where}: impl='pallas' has no TPU kernel yet; use impl='auto', 'xla' or 'reference'")
