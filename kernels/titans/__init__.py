"""Titans' neural memory (Behrouz, Zhong & Mirrokni 2025): per head a memory trained on each document as it is
read, by gradient descent with momentum and weight decay on ||M(k) - v||^2, all gradients of a mini-batch of C
tokens taken at its start; o_t = M_t(q_t). The linear memory M(k) = k M (reference.py has the equations and the
state) when W0 is an array; the deep memory, a two-layer MLP M(k) = gelu(k M1) M2 (reference_mlp.py), when W0
is a pair (W1_0, W2_0), and then each of W_s, M, S in the state is such a pair.

Modes: "recurrent" (reference.py / reference_mlp.py, token by token) and "chunk" (chunk.py / chunk_mlp.py, a
mini-batch's tokens in parallel).
impl: "reference" runs reference.py whatever the mode, "xla" / "auto" the mode's form; there is no Pallas
kernel.

The interface keeps two starts apart: W0 (the learned initial memory, a parameter) is where every document
starts; `initial_state` (W_s, M, S, pos) continues a call from where the last one stopped, which may be
mid-mini-batch. With initial_state None the first document starts from W0 too.
"""

from jaxtyping import Array, Float, Int

from kernels import check_mode, check_no_pallas
from kernels.titans.chunk import titans_chunk
from kernels.titans.chunk_mlp import titans_mlp_chunk
from kernels.titans.reference import titans_reference, titans_step
from kernels.titans.reference_mlp import titans_mlp_reference, titans_mlp_step

MODES = ("recurrent", "chunk")


def titans(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
           theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"], log_decay: Float[Array, "B T H"],
           W0: Float[Array, "H K V"] | tuple, *, mini_batch_size: int, segment_ids: Int[Array, "B T"] | None = None,
           initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
           impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final state or None).

    theta: each token's inner learning rate theta_t >= 0; log_eta: log of its momentum eta_t; log_decay: log of
    its retention 1 - alpha_t (all (B, T, H)); W0: the learned initial memory, (H, K, V) linear or the pair
    (H, K, F), (H, F, V) of the two-layer MLP memory; mini_batch_size: C, the tokens
    whose gradients share one anchor. The state is (W_s, M, S (B, H, K, V) float32, pos (B,) int32): the current
    mini-batch's start, the memory and the surprise after the last token, the next token's position in the
    mini-batch. segment_ids: a document start restarts from (W0, W0, 0, 0) (kernels/__init__.py's
    conventions, with W0 in place of a zero state).
    """
    check_mode(mode, mini_batch_size, "titans", MODES)
    check_no_pallas(impl, "titans")
    reference, chunk = (titans_mlp_reference, titans_mlp_chunk) if isinstance(W0, tuple) else \
        (titans_reference, titans_chunk)
    form = reference if mode == "recurrent" or impl == "reference" else chunk
    o, state = form(q, k, v, theta, log_eta, log_decay, W0, mini_batch_size=mini_batch_size,
                    segment_ids=segment_ids, initial_state=initial_state)
    return o, (state if output_final_state else None)


__all__ = ["titans", "titans_reference", "titans_chunk", "titans_step", "titans_mlp_reference", "titans_mlp_chunk",
           "titans_mlp_step", "MODES"]
