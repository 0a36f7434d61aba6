"""Mixture of Memories (Du et al. 2025, "MoM: Linear Sequence Modeling with Mixture-of-Memories", arXiv
2502.13685), token by token and memory by memory in float32: the truth for the masked delta-rule form
(kernels/mom/__init__.py).

E memories, each a (gated) delta-rule state S^m (H heads of K x V). A router has already chosen, per
token, the memories it writes (`routed`, the top-k of M plus an always-on shared memory) and their mixing
weights (`weights`, the renormalised router scores; 1 for the shared memory; 0 for a memory not chosen).
Per token t and memory m, with the token's own key, value, write strength and decay for that memory:

    routed[t, m]:   S^m_t = alpha^m_t (I - beta^m_t k^m_t k^m_t^T) S^m_{t-1} + beta^m_t k^m_t v^m_t^T
    otherwise:      S^m_t = S^m_{t-1}                         (a memory is written only by its tokens)
    o_t = scale * sum_m weights[t, m] (S^m_t)^T q_t            (the query reads the mixed memory)

alpha^m_t = exp(g^m_t) (g = None: alpha = 1, MoM over plain DeltaNet). The query q_t is shared by the
memories (fla's single q_proj). The read-out of the mixture equals the mixture of the read-outs, which is
how the paper writes it: o_t = q_t^T (sum_m w_m S^m_t).

Code names: `state` = (S^1 .. S^E) stacked, (B, E, H, K, V); `routed` (B, T, E) bool; `weights` (B, T, E).
Packed documents: at t >= 1 where segment_ids changes, every memory restarts from zero before the update;
token 0 continues `initial_state`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.segments import entering_state, scan_documents


def mom_step(q: Float[Array, "B H K"], k: Float[Array, "B E H K"], v: Float[Array, "B E H V"],
             beta: Float[Array, "B E H"], g: Float[Array, "B E H"] | None, routed: Bool[Array, "B E"],
             weights: Float[Array, "B E"], state: Float[Array, "B E H K V"], scale: float
             ) -> tuple[Float[Array, "B H V"], Float[Array, "B E H K V"]]:
    """One token through every memory (the memory axis E), float32: returns (o_t (B, H, V), the E states after it)."""
    q, k, v, beta, weights = (x.astype(jnp.float32) for x in (q, k, v, beta, weights))
    S = state.astype(jnp.float32)  # (B, E, H, K, V)
    alpha = jnp.ones_like(beta) if g is None else jnp.exp(g.astype(jnp.float32))  # (B, E, H)
    b = beta[..., None, None]
    decayed = alpha[..., None, None] * S  # alpha S_{t-1}
    erased = decayed - b * jnp.einsum("BEHK,BEHJ,BEHJV->BEHKV", k, k, decayed)  # (I - beta k k^T) alpha S_{t-1}
    written = erased + b * jnp.einsum("BEHK,BEHV->BEHKV", k, v)  # + beta k v^T
    S = jnp.where(routed[..., None, None, None], written, S)  # a memory the token skips is left as it was
    o = scale * jnp.einsum("BE,BEHKV,BHK->BHV", weights, S, q)  # sum_m w_m (S^m)^T q
    return o, S


def mom_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T E H K"], v: Float[Array, "B T E H V"],
                  beta: Float[Array, "B T E H"], g: Float[Array, "B T E H"] | None, routed: Bool[Array, "B T E"],
                  weights: Float[Array, "B T E"], *, scale: float, segment_ids: Int[Array, "B T"] | None = None,
                  initial_state: Float[Array, "B E H K V"] | None = None
                  ) -> tuple[Float[Array, "B T H V"], Float[Array, "B E H K V"]]:
    """Scan of `mom_step` over time. Returns (o (B, T, H, V) in q's dtype, final states float32)."""
    B, T, E, H, K = k.shape
    state = entering_state(initial_state, (B, E, H, K, v.shape[-1]))
    step = lambda S, *x: mom_step(*x, S, scale)
    o, state = scan_documents(step, state, (q, k, v, beta, g, routed, weights), segment_ids)
    return o.astype(q.dtype), state
