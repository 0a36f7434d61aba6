"""MesaNet's chunk and parallel forms: the same conjugate-gradient iterations as reference.py, with every
product A_t p_t = H_t p_t + lambda ⊙ p_t for all t at once taken by a pass of the GLA op (kernels/gla):
H_t p_t = sum_{s <= t} (prod_{s < u <= t} gamma_u) beta_s k_s (k_s . p_t) + (decayed H_0) p_t is gated
linear attention with query p, keys beta ⊙ k, values k, the gate broadcast over the key channels and
scale 1. The output G_t^T x_t is one more pass (values v), and the final H_T one more, so the form costs
cg_steps + 2 passes of the GLA op in its chunk or parallel form (or its Pallas kernels): T K^2 per pass
instead of the reference's per-token K x K solve on a materialised H_t.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.gla import gla
from kernels.mesa.reference import conjugate_gradients
from kernels.segments import entering_state


def mesa_gla(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
             g: Float[Array, "B T H"], beta: Float[Array, "B T H"], lamb: Float[Array, "H K"], *, cg_steps: int,
             mode: str, chunk_size: int, impl: str, segment_ids: Int[Array, "B T"] | None = None,
             initial_state: tuple | None = None):
    """Returns (o (B, T, H, V) in q's dtype, (H_T, G_T) float32); mode "chunk" or "parallel" of the GLA op."""
    B, T, H, K = q.shape
    H0, G0 = initial_state or (None, None)
    H0 = entering_state(H0, (B, H, K, K))
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v = f32(q), f32(k), f32(v)
    gk = jnp.broadcast_to(f32(g)[..., None], k.shape)  # (B, T, H, K): the scalar gate on every key channel
    kb = f32(beta)[..., None] * k  # (B, T, H, K)
    run = lambda query, values, S0, final=False: gla(query, kb, values, gk, scale=1.0, segment_ids=segment_ids,
                                                     initial_state=S0, output_final_state=final, mode=mode,
                                                     chunk_size=chunk_size, impl=impl)
    lamb = f32(lamb)
    x = conjugate_gradients(lambda p: run(p, k, H0)[0] + lamb * p, q, cg_steps)  # (B, T, H, K)
    o, G_T = run(x, v, G0, final=True)
    H_T = run(q, k, H0, final=True)[1]  # its output is unused: the final state does not depend on the query
    return o, (H_T, G_T)
