"""Titans' neural memory (Behrouz, Zhong & Mirrokni 2025), the linear memory: per head a matrix M trained on each
document as it is read, by gradient descent with momentum and weight decay on ||k M - v||^2, all gradients of
a mini-batch of C tokens taken at its start; o_t = q_t M_t (reference.py has the equations and the state).

Modes: "recurrent" (reference.py, token by token) and "chunk" (chunk.py, a mini-batch's tokens in parallel).
impl: "reference" runs reference.py whatever the mode, "xla" / "auto" the mode's form; there is no Pallas
kernel.

The interface keeps two starts apart: W0 (the learned initial memory, a parameter) is where every document
starts; `initial_state` (W_s, M, S, pos) continues a call from where the last one stopped, which may be
mid-mini-batch. With initial_state None the first document starts from W0 too.
"""

from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.titans.chunk import titans_chunk
from kernels.titans.reference import titans_reference, titans_step

MODES = ("recurrent", "chunk")


def titans(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
           theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"], log_decay: Float[Array, "B T H"],
           W0: Float[Array, "H K V"], *, mini_batch_size: int, segment_ids: Int[Array, "B T"] | None = None,
           initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
           impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final state or None).

    theta: each token's inner learning rate theta_t >= 0; log_eta: log of its momentum eta_t; log_decay: log of
    its retention 1 - alpha_t (all (B, T, H)); W0: the learned initial memory; mini_batch_size: C, the tokens
    whose gradients share one anchor. The state is (W_s, M, S (B, H, K, V) float32, pos (B,) int32): the current
    mini-batch's start, the memory and the surprise after the last token, the next token's position in the
    mini-batch. segment_ids: a document start restarts from (W0, W0, 0, 0) (kernels/__init__.py's
    conventions, with W0 in place of a zero state).
    """
    check_mode(mode, mini_batch_size, "titans", MODES)
    check_no_pallas(impl, "titans")
    form = titans_reference if mode == "recurrent" or impl == "reference" else titans_chunk
    o, state = form(q, k, v, theta, log_eta, log_decay, W0, mini_batch_size=mini_batch_size,
                    segment_ids=segment_ids, initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["titans", "titans_reference", "titans_chunk", "titans_step", "MODES"]
