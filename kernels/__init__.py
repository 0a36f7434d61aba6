"""Pure array functions, one folder per op, layout [B, T, H, D]. No Flax here.

Conventions shared by every op (each op's docstring refers here):

- `impl` is one of IMPLS: "reference" (the token-by-token truth), "xla" (the XLA form picked by
  `mode`), "pallas" (the Pallas kernels of `pallas_platform()`), "auto" (see `use_pallas`).
- `mode` is one of MODES where an op has several exact forms; every mode computes the same function.
- `segment_ids` (B, T) int32 marks packed documents: a recurrence restarts from a zero state at each
  t >= 1 where the id changes, and attention lets a query see only keys of its own id.
- `initial_state` is the state before token 0; token 0 always continues it, whatever its segment id
  (a decode step never needs the previous token's id). With both given, the state carries into the
  first document of the call and every later document starts from zero. None means a zero state.

Letters of the shape annotations (jaxtyping, checked at run time in the test suite), one legend for
the whole code base:

    B batch           T time (queries)        S time (keys, a KV cache's slots)   D model width
    H heads           G kv heads, or groups   R query heads per kv head (H / G)   K key/query head dim
    V value head dim  N state size (SSM)      P SSM head dim (Mamba-2)            E experts
    F features, or FFN hidden width           W a short convolution's window state (kernel_size - 1)
    C chunk           Dm Mamba's inner channels (expand * D), the selective scan's channels
    Nh Householder (delta-rule) steps per token (DeltaProduct)           L Fenwick levels (log-linear attention)
    n residual streams (mHC, model.residual)     M memory slots (GSA)     Mr MIMO rank (Mamba-3)

Products like `H*K` are checked too; `#B` also accepts 1 (broadcast); a name with a leading
underscore (`_V1`) documents a dimension that is not checked.
"""

import os

import jax

IMPLS = ("auto", "reference", "xla", "pallas")
MODES = ("recurrent", "chunk", "parallel")

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


def check_no_pallas(impl: str, where: str):
    """Refuse an unknown `impl`, and impl="pallas" for an op that has no Pallas kernel (rather than run XLA
    under it), naming `where`."""
    check_impl(impl, where)
    if impl == "pallas":
        raise ValueError(f"{where}: impl='pallas' has no kernel here; expected 'auto', 'reference' or 'xla'")


def check_mode(mode: str, chunk_size: int, where: str, modes: tuple = MODES):
    """Refuse an unknown `mode` or a chunk_size < 1, naming `where`."""
    if mode not in modes:
        raise ValueError(f"{where}: mode={mode!r}; expected one of {modes}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{where}: chunk_size={chunk_size!r}; expected a positive int")
