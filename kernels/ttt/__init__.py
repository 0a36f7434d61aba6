"""TTT-Linear (Sun et al. 2024): per head an inner linear model W, b trained on each document as it is read, by
gradient descent in mini-batches of C tokens on 1/2 |LN(k W + b) - (v - k)|^2; o_t = q_t + LN(q_t W_t + b_t)
(reference.py has the equations and the state).

Modes: "recurrent" (reference.py, token by token) and "chunk" (dual.py, the dual form: a mini-batch's tokens in
parallel). impl: "reference" runs reference.py whatever the mode, "xla" / "auto" the mode's form; there is no
Pallas kernel.

The interface keeps two starts apart: W0, b0 (the learned initial inner model, a parameter) are where every
document starts; `initial_state` (W_s, b_s, G, g, pos) continues a call from where the last one stopped, which
may be mid-mini-batch. With initial_state None the first document starts from W0, b0 too.
"""

from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.ttt.dual import ttt_linear_dual
from kernels.ttt.reference import layer_norm, loss_grad, ttt_linear_reference, ttt_linear_step

MODES = ("recurrent", "chunk")


def ttt_linear(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
               eta: Float[Array, "B T H"], W0: Float[Array, "H K K"], b0: Float[Array, "H K"],
               ln_w: Float[Array, "H K"], ln_b: Float[Array, "H K"], scale: Float[Array, " C"], *,
               segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
               output_final_state: bool = False, mode: str = "chunk", impl: str = "auto"):
    """Returns (o (B, T, H, K) in q's dtype, final state or None).

    eta: each token's inner learning rate (B, T, H); scale: the factor a_p of each position p in a mini-batch,
    its length the mini-batch size C; ln_w, ln_b: the inner LayerNorm's weight and bias. The state is (W_s
    (B, H, K, K), b_s (B, H, K), G (B, H, K, K), g (B, H, K)) float32 and pos (B,) int32: the current
    mini-batch's start, its learning-rate-weighted gradient sums so far, the next token's position in it.
    segment_ids: a document start restarts from (W0, b0) at position 0 (kernels/__init__.py's conventions,
    with W0, b0 in place of a zero state).
    """
    check_mode(mode, int(scale.shape[0]), "ttt_linear", MODES)
    check_no_pallas(impl, "ttt_linear")
    form = ttt_linear_reference if mode == "recurrent" or impl == "reference" else ttt_linear_dual
    o, state = form(q, k, v, eta, W0, b0, ln_w, ln_b, scale, segment_ids=segment_ids, initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["ttt_linear", "ttt_linear_reference", "ttt_linear_dual", "ttt_linear_step", "layer_norm", "loss_grad"]
