"""Mixture of Memories (Du et al. 2025, MoM): E gated delta-rule memories, each written only by the tokens
routed to it, read by a shared query and mixed by the router's weights (reference.py has the equations).

The masked form, exact: a memory that a token skips is left unchanged, S^m_t = S^m_{t-1}, which is a
gated delta-rule step with beta = 0 and log-decay g = 0 (alpha = 1). So memory m over the whole sequence
is the delta-rule op (kernels/delta_rule) on its own keys and values with beta and g masked by the
routing, and all E memories run as E x H heads of ONE delta-rule call (the query repeated per memory).
A token's read-out of every memory comes back, routed or not (an unrouted memory's read-out is its
unchanged state read by the query), and the mix drops the unrouted ones by their zero weights:

    o_t = sum_m weights[t, m] o^m_t,    o^m = delta_rule(q, k^m, v^m, routed^m * beta^m, routed^m * g^m)

Every mode ("recurrent", "chunk", "parallel") and implementation ("xla", "pallas") of the delta-rule op
serves unchanged, packed documents (segment_ids restart every memory) and initial / final states included.
impl="reference" runs reference.py (the token-by-token loop over memories) whatever the mode.
Cost: E memories over all T tokens, E x the work of one delta-rule layer of H heads, where fla's layer
gathers each memory's tokens first (about (top_k + 1) / E of it); the masked form keeps fixed shapes.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels import check_impl, check_mode
from kernels.delta_rule import delta_rule
from kernels.mom.reference import mom_reference, mom_step


def mom(q: Float[Array, "B T H K"], k: Float[Array, "B T E H K"], v: Float[Array, "B T E H V"],
        beta: Float[Array, "B T E H"], g: Float[Array, "B T E H"] | None, routed: Bool[Array, "B T E"],
        weights: Float[Array, "B T E"], *, scale: float | None = None, segment_ids: Int[Array, "B T"] | None = None,
        initial_state: Float[Array, "B E H K V"] | None = None, output_final_state: bool = False,
        mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"
        ) -> tuple[Float[Array, "B T H V"], Float[Array, "B E H K V"] | None]:
    """q (B, T, H, K) the shared query; k (B, T, E, H, K), v (B, T, E, H, V), beta in (0, 1) and g (log-decay
    <= 0, or None) (B, T, E, H) each memory's; routed (B, T, E) which memories each token writes; weights
    (B, T, E) the mix of the read-outs (zero where not routed, for the masked form to equal the reference).
    scale defaults to K^-1/2; segment_ids / initial_state (B, E, H, K, V) as every op (kernels/__init__.py).
    Returns (o (B, T, H, V) in q's dtype, final states (B, E, H, K, V) float32 or None)."""
    check_mode(mode, chunk_size, "mom")
    check_impl(impl, "mom")
    B, T, E, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    if impl == "reference":
        o, final = mom_reference(q, k, v, beta, g, routed, weights, scale=scale, segment_ids=segment_ids,
                                 initial_state=initial_state)
        return o, (final if output_final_state else None)
    mask = routed[..., None]  # (B, T, E, 1)
    heads = lambda a: a.reshape(B, T, E * H, *a.shape[4:])  # (B, T, E H[, K or V]): memories as heads
    qe = jnp.broadcast_to(q[:, :, None], (B, T, E, H, K))  # (B, T, E, H, K): one query reads every memory
    beta = jnp.where(mask, beta, 0)  # beta = 0 writes nothing
    g = None if g is None else jnp.where(mask, g, 0)  # log-decay 0: alpha = 1, no decay
    S0 = None if initial_state is None else initial_state.reshape(B, E * H, K, -1)  # (B, E H, K, V)
    o, final = delta_rule(heads(qe), heads(k), heads(v), heads(beta), None if g is None else heads(g), scale=scale,
                          segment_ids=segment_ids, initial_state=S0, output_final_state=output_final_state,
                          mode=mode, chunk_size=chunk_size, impl=impl)
    o = o.reshape(B, T, E, H, -1)  # (B, T, E, H, V)
    o = jnp.einsum("BTEHV,BTE->BTHV", o.astype(jnp.float32), weights.astype(jnp.float32)).astype(q.dtype)
    return o, (None if final is None else final.reshape(B, E, H, K, -1))  # (B, E, H, K, V)


__all__ = ["mom", "mom_reference", "mom_step"]
