"""TTT-Linear and TTT-MLP (Sun et al. 2024): per head an inner model f trained on each document as it is read, by
gradient descent in mini-batches of C tokens on 1/2 |LN(f(k)) - (v - k)|^2; o_t = q_t + LN(f_t(q_t)). TTT-Linear:
f(x) = x W + b (reference.py has the equations and the state); TTT-MLP: f(x) = gelu(x W1 + b1) W2 + b2
(reference_mlp.py), the same loss, mini-batches, state layout and documents.

Modes: "recurrent" (reference.py / reference_mlp.py, token by token) and "chunk" (dual.py / dual_mlp.py, the
dual form: a mini-batch's tokens in parallel). impl: "reference" runs the reference whatever the mode, "xla" /
"auto" the mode's form; there is no Pallas kernel.

The interface keeps two starts apart: W0, b0 (the learned initial inner model, a parameter) are where every
document starts; `initial_state` (W_s, b_s, G, g, pos) continues a call from where the last one stopped, which
may be mid-mini-batch. With initial_state None the first document starts from W0, b0 too. TTT-MLP's the same
with W1, b1, W2, b2.
"""

from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.ttt.dual import ttt_linear_dual
from kernels.ttt.dual_mlp import ttt_mlp_dual
from kernels.ttt.reference import layer_norm, loss_grad, ttt_linear_reference, ttt_linear_step
from kernels.ttt.reference_mlp import ttt_mlp_reference, ttt_mlp_step

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


def ttt_mlp(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
            eta: Float[Array, "B T H"], W1: Float[Array, "H K F"], b1: Float[Array, "H F"], W2: Float[Array, "H F K"],
            b2: Float[Array, "H K"], ln_w: Float[Array, "H K"], ln_b: Float[Array, "H K"], scale: Float[Array, " C"],
            *, segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
            output_final_state: bool = False, mode: str = "chunk", impl: str = "auto"):
    """TTT-MLP: returns (o (B, T, H, K) in q's dtype, final state or None), arguments as `ttt_linear`'s with the
    learned start W1, b1, W2, b2 (F the hidden width) in place of W0, b0. The state is (W1, b1, W2, b2, G1, g1,
    G2, g2, pos): the current mini-batch's start (with B in front), the eta-weighted gradient sums of each, and
    the next token's position (B,) int32."""
    check_mode(mode, int(scale.shape[0]), "ttt_mlp", MODES)
    check_no_pallas(impl, "ttt_mlp")
    form = ttt_mlp_reference if mode == "recurrent" or impl == "reference" else ttt_mlp_dual
    o, state = form(q, k, v, eta, (W1, b1, W2, b2), ln_w, ln_b, scale, segment_ids=segment_ids,
                    initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["ttt_linear", "ttt_linear_reference", "ttt_linear_dual", "ttt_linear_step", "layer_norm", "loss_grad",
           "ttt_mlp", "ttt_mlp_reference", "ttt_mlp_dual", "ttt_mlp_step"]
