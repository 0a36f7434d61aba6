"""Pure array functions, one folder per op, layout [B, T, H, D]. No Flax here."""

import os

import jax

IMPLS = ("auto", "reference", "xla", "pallas")

# The Pallas kernels pass their tests on CPU in interpret mode and lower for CUDA and TPU, but have
# not yet run on a device. Until a device run of `python -m benchmarks.kernels` verifies them,
# impl="auto" keeps to XLA unless ZOO_AUTO_PALLAS=1 is set; impl="pallas" always runs them.
AUTO_PALLAS = os.environ.get("ZOO_AUTO_PALLAS") == "1"


def pallas_platform() -> str:
    """Which kernels impl="pallas" runs: "tpu" (the `pallas_tpu.py` files, Mosaic TPU) on a TPU,
    "gpu" (the `pallas.py` files, Triton) elsewhere. Off their device both run in interpret mode;
    ZOO_PALLAS_PLATFORM=tpu (or gpu) picks the family there, e.g. to test the TPU kernels on CPU."""
    if jax.default_backend() in ("gpu", "tpu"):
        return jax.default_backend()
    return os.environ.get("ZOO_PALLAS_PLATFORM", "gpu")


def use_pallas(impl: str, supported: bool) -> bool:
    """The one dispatch rule: impl="pallas" always runs the Pallas kernels; impl="auto" runs them
    on a GPU or TPU when AUTO_PALLAS is set and the op's `supports()` holds for the call."""
    return impl == "pallas" or (impl == "auto" and AUTO_PALLAS and supported
                                and jax.default_backend() in ("gpu", "tpu"))


def check_impl(impl: str, where: str):
    """Refuse an unknown `impl`, naming `where`."""
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl={impl!r}; expected one of {IMPLS}")
