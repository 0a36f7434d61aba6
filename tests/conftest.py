import os
import tempfile

# Keep the tokenised-corpus cache of the test run away from the user's.
os.environ.setdefault("ZOO_CACHE", os.path.join(tempfile.gettempdir(), "zoo-test-cache"))
# Tests use tiny shapes, so XLA compile time dominates: skip the expensive backend passes
# (about a third less CPU time; results are the same functions). Set before JAX starts its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
