import os
import tempfile

# Keep the tokenised-corpus cache of the test run away from the user's.
os.environ.setdefault("ZOO_CACHE", os.path.join(tempfile.gettempdir(), "zoo-test-cache"))
# Compiling dominates the suite's time (tiny shapes): XLA's cheapest CPU optimisation level makes
# it about a third faster. Both sides of every comparison compile alike. Read when the first jax
# backend starts, which is after this file runs.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
