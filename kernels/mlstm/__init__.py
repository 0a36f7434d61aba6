"""The mLSTM cell of xLSTM (Beck et al., 2024; chunkwise: Beck et al., 2025, "xLSTM 7B"): a matrix
memory with exponential input gate, sigmoid forget gate, normaliser and max stabiliser, per head.

See reference.py for the equations and the state (C, n, m), parallel.py (the quadratic form with the
log-gate matrix D, O(T^2) memory) and chunk.py (states between chunks, quadratic inside) for the fast
forms. All three compute the same outputs and the same final state.

impl: "xla" (and "auto") runs the XLA form picked by `mode`; "reference" the token-by-token scan
whatever the mode. There is no Pallas kernel: impl="pallas" is refused.
"""

from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.mlstm.chunk import mlstm_chunk
from kernels.mlstm.parallel import mlstm_parallel
from kernels.mlstm.reference import mlstm_reference, mlstm_step, zero_state

_FORMS = {"recurrent": mlstm_reference, "chunk": mlstm_chunk, "parallel": mlstm_parallel}


def mlstm(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
          i_pre: Float[Array, "B T H"], f_pre: Float[Array, "B T H"], *, segment_ids: Int[Array, "B T"] | None = None,
          initial_state: tuple[Float[Array, "B H K V"], Float[Array, "B H K"], Float[Array, "B H"]] | None = None,
          output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (h (B, T, H, V) in q's dtype, final state (C (B, H, K, V), n (B, H, K), m (B, H)) float32 or None).

    i_pre, f_pre: the input and forget gates' pre-activations ĩ, f̃ (log f = logsigmoid(f̃)). k is scaled
    by K^-1/2 inside. mode: "recurrent", "chunk" or "parallel"; all give the same result. impl: "auto",
    "reference" or "xla" (module docstring). segment_ids / initial_state: token 0 continues initial_state
    (the zero state C = 0, n = 0, m = 0 when None), every later document start restarts from the zero
    state (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "mlstm")
    check_no_pallas(impl, "mlstm")
    mode = "recurrent" if impl == "reference" else mode
    kwargs = {"chunk_size": chunk_size} if mode == "chunk" else {}
    h, state = _FORMS[mode](q, k, v, i_pre, f_pre, segment_ids=segment_ids, initial_state=initial_state, **kwargs)
    return h, (state if output_final_state else None)


__all__ = ["mlstm", "mlstm_step", "mlstm_reference", "mlstm_chunk", "mlstm_parallel", "zero_state"]
