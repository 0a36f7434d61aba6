import collections
import gc
import os
import tempfile

import jax
import jaxtyping
import pytest

# JAX's persistent compilation cache (train.run turns it on) stays off in the suite: writing a CPU
# executable to it segfaulted an xdist worker (jax 0.10.2, compilation_cache.put_executable_and_time,
# in whichever test compiled next after a training run), and a test run gains nothing from it.
jax.config.update("jax_enable_compilation_cache", False)

# Every function and dataclass of the packages is checked against its annotations at run time:
# jaxtyping's import hook with beartype (as equinox's suite does), installed before any of them is
# imported. An int passes for a float, as PEP 484 says. (Not through pytest's --jaxtyping-packages:
# jaxtyping 0.3's option parser splits a typechecker with arguments at its commas.)
jaxtyping.install_import_hook(["kernels", "layers", "zoo", "infer", "train"],
                              "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

# Keep the tokenised-corpus cache of the test run away from the user's.
os.environ.setdefault("ZOO_CACHE", os.path.join(tempfile.gettempdir(), "zoo-test-cache"))
# Compiling dominates the suite's time (tiny shapes): XLA's cheapest CPU optimisation level makes it
# about a third faster, and the older loop emitters for fusions a quarter faster again (measured on the
# layer protocol tests, the Pallas interpreter tests and the config runs, 2026-12-02); LLVM code
# generation in one piece instead of split across threads, which two workers on two cores only
# contend for: a tenth less compile time in tests/zoo/test_kinds.py alone, and the suite's CPU time
# 920 s instead of 1,143 (2026-12-06, one run each, test_impl's single traces in the same run).
# Both sides of every comparison compile alike. Read when the first jax backend starts, which is after this file runs.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
# Tracing makes objects by the million: with Python's default thresholds (700, 10, 10) the cyclic
# collector took 11.7 s of 92 in tests/layers/test_conformance.py + tests/zoo/test_kinds.py, with
# (50,000, 10, 10) 4.2 s, at the same peak memory (1.74 and 1.82 GB; gc.callbacks, 2026-12-06).
gc.set_threshold(50_000, 10, 10)

# The files that wait on subprocesses longest (module fixtures of minutes, the notebooks' kernels, a benchmark
# script) go first, so that their waits overlap the other worker's files; the others follow by their number of
# tests, most first. pytest-xdist's own order (by number of tests alone, off in pyproject.toml) put files with few
# tests last, tests/test_benchmarks.py (2 tests, a 25 s subprocess) and tests/test_notebooks.py (10) among them.
# `make test` 1,132 s with this order and part c apart, 1,172 s before (2026-12-07, one run each, shared machine).
FIRST = ("tests/train/test_sharding.py", "tests/train/test_sharding_context.py", "tests/kernels/test_context.py",
         "tests/test_notebooks.py", "tests/test_benchmarks.py")


def pytest_collection_modifyitems(items):
    files = collections.Counter(item.nodeid.split("::")[0] for item in items)
    first = lambda file: FIRST.index(file) if file in FIRST else len(FIRST)
    items.sort(key=lambda item: (first(f := item.nodeid.split("::")[0]), -files[f]))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """A worker drops its compiled programs after a test file once it holds over 30,000 memory maps.
    Every XLA CPU executable keeps its machine code in maps of its own, and a worker that kept them all
    reached 57,934 of Linux's default 65,530 (vm.max_map_count) by the end of `make test`
    (2026-12-05); past the limit the next compile segfaults (CI's worker did, in
    backend_compile_and_load, and the suite hung). Clearing after every file instead spent 51 s of the
    suite's time in those teardowns (pytest --durations, 2026-12-06), and recompiled what files share."""
    yield
    with open("/proc/self/maps") as f:
        if sum(1 for _ in f) > 30_000:
            jax.clear_caches()
            gc.collect()
