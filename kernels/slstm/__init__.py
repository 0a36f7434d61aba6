"""sLSTM (Beck et al. 2024, "xLSTM"): the scalar-memory LSTM with exponential input gating, a
stabiliser state and recurrent connections through the previous output (reference.py for the
equations and symbols).

One form only: the token-by-token scan of reference.py, which "auto", "xla" and "reference" all run.
The recurrence through h_{t-1} (R h_{t-1} in every gate) admits no chunkwise or parallel form, so the
op has no `mode`; the official code's speed comes from a fused CUDA kernel that keeps R in registers
across time steps, and there is no Pallas counterpart here: impl="pallas" is refused.

Layout: x (B, T, 4, H, K), the pre-activations W x_t of the gates (i, f, z, o) on axis 2, per head;
R (4, H, K, K) the recurrent blocks; b (4, H, K) the biases. The state is a tuple (c, n, m, h), each
(B, H, K) float32. segment_ids / initial_state follow kernels/__init__.py: token 0 continues
initial_state (zero when None), every later document start restarts from the zero state (an empty
state: the stabiliser starts at the document's first ĩ).
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.slstm.reference import STATE, log_forget, slstm_reference, slstm_step

FORGET_GATES = ("sigmoid", "exp")


def slstm(x: Float[Array, "B T 4 H K"], R: Float[Array, "4 H K K"], b: Float[Array, "4 H K"] | None = None, *,
          segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
          output_final_state: bool = False, forget_gate: str = "sigmoid", impl: str = "auto"):
    """Returns (h (B, T, H, K) in x's dtype, the final state (c, n, m, h) (B, H, K) float32 or None).

    forget_gate: "sigmoid" (log f = logsigmoid(f̃), the official default) or "exp" (log f = f̃)."""
    check_no_pallas(impl, "slstm")
    if forget_gate not in FORGET_GATES:
        raise ValueError(f"slstm: forget_gate={forget_gate!r}; expected one of {FORGET_GATES}")
    B, T, G, H, K = x.shape
    if G != 4 or R.shape != (4, H, K, K) or b is not None and b.shape != (4, H, K):
        raise ValueError(f"slstm: expected x (B, T, 4, H, K), R (4, H, K, K), b (4, H, K); got x {x.shape}, "
                         f"R {R.shape}, b {None if b is None else b.shape}")
    if initial_state is not None and (len(initial_state) != 4 or any(s.shape != (B, H, K) for s in initial_state)):
        raise ValueError(f"slstm: initial_state must be (c, n, m, h), each (B, H, K) = {(B, H, K)}")
    h, state = slstm_reference(x, R, b, segment_ids=segment_ids, initial_state=initial_state,
                               forget_gate=forget_gate)
    return h.astype(x.dtype), (state if output_final_state else None)


__all__ = ["FORGET_GATES", "STATE", "log_forget", "slstm", "slstm_reference", "slstm_step"]
