"""The CPU kernels written in C++ (kernels/*/cpu.cc, with kernels/native.h), as XLA FFI custom calls: each is
compiled on first use with the machine's C++ compiler ($CXX, default c++; -O3 -march=native) into
$ZOO_CACHE/ffi (default ~/.cache/zoo), keyed by its source, native.h, the jaxlib version and the CPU's flags,
and loaded from there afterwards. Without a compiler, or with ZOO_CPU_KERNELS=0, `load` returns False and the
ops run their XLA forms."""

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import jax

HEADER = Path(__file__).with_name("native.h")


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def load(source: Path, targets: tuple[tuple[str, str], ...]) -> bool:
    """Compiles `source` (once per machine) and registers its (symbol, target name) handlers for the CPU;
    False, with a warning when the compiler fails, if that cannot be done. ZOO_CPU_KERNELS=0, read at every
    call, turns every kernel off."""
    return os.environ.get("ZOO_CPU_KERNELS", "1") != "0" and _build(source, targets)


@functools.cache
def _build(source: Path, targets: tuple[tuple[str, str], ...]) -> bool:
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return False
    text = source.read_bytes() + HEADER.read_bytes() + jax.lib.__version__.encode() + _cpu_flags().encode()
    cache = Path(os.environ.get("ZOO_CACHE", Path.home() / ".cache" / "zoo")) / "ffi"
    library = cache / f"{source.parent.name}_{source.stem}_{hashlib.sha256(text).hexdigest()[:16]}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # renamed when whole: parallel builds never clash
        command = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir(),
                   "-I", str(HEADER.parent), str(source), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            warnings.warn(f"{source} did not compile ({' '.join(command)}): {done.stderr[-2000:]}; its op runs its "
                          "XLA forms", stacklevel=3)
            return False
        os.replace(partial, library)
    lib = ctypes.cdll.LoadLibrary(str(library))
    for symbol, target in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def on_one_cpu() -> bool:
    """Whether a call traced now runs on the CPU and not under a mesh of several devices (XLA's partitioner
    would gather a custom call's operands whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() == "cpu" and (mesh.empty or mesh.size == 1)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One cpu.cc: its (symbol, target name) handlers, and what its op runs without them (for the error)."""

    source: Path
    targets: tuple[tuple[str, str], ...]
    fallback: str

    def available(self) -> bool:
        return load(self.source, self.targets)

    def call(self, target: str, out, *args, **attrs):
        """jax.ffi.ffi_call of `target` (vmapped one call at a time), after building the kernels."""
        if not self.available():
            raise RuntimeError(f"{target}: the kernels of {self.source.relative_to(HEADER.parent.parent)} are not "
                               f"available on this machine (kernels/native.py); {self.fallback}")
        return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)
