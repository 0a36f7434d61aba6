"""Gated slot attention (Zhang et al., 2024): per head M slots, K~_t = diag(alpha_t) K~_{t-1} + s_t k_t^T,
V~_t = diag(alpha_t) V~_{t-1} + s_t v_t^T, o_t = V~_t^T softmax(scale * K~_t q_t), with the log forget gate
g = log alpha <= 0 and the write strength s given by the caller (reference.py has the equations).

Modes: "recurrent" (reference.py, both passes token by token), "chunk" and "parallel" (chunk.py: the slot
scores in a chunked or quadratic form of their own, then the GLA op in that form); all compute the same
function. impl: "reference" runs reference.py whatever the mode; "xla" and "auto" the mode's form; "pallas"
the GLA op's Pallas kernels for pass 2 (pass 1 stays XLA).
"""

from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.gsa.chunk import gsa_two_pass, slot_scores_chunk, slot_scores_parallel
from kernels.gsa.reference import gsa_reference, gsa_step


def gsa(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
        s: Float[Array, "B T H M"], g: Float[Array, "B T H M"], *, scale: float | None = None,
        segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None,
        output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final (K~ (B, H, M, K), V~ (B, H, M, V)) float32 or None).

    g: log alpha <= 0 per slot (not checked); s: the write strength per slot (1 - alpha in the layer).
    scale multiplies q in the slot scores; None means K^-1/2 (as flash-linear-attention's chunk_gsa).
    initial_state: (K~_0, V~_0) or None; segment_ids as every op (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "gsa")
    check_impl(impl, "gsa")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(scale=scale, segment_ids=segment_ids, initial_state=initial_state)
    if mode == "recurrent" or impl == "reference":
        o, state = gsa_reference(q, k, v, s, g, **kwargs)
    else:
        o, state = gsa_two_pass(q, k, v, s, g, mode=mode, chunk_size=chunk_size, impl=impl, **kwargs)
    return o, (state if output_final_state else None)


__all__ = ["gsa", "gsa_step", "gsa_reference", "gsa_two_pass", "slot_scores_chunk", "slot_scores_parallel"]
