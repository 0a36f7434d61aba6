"""Gated DeltaNet-2's recurrence (reference.py): S_t = (I - k_t (b_t ⊙ k_t)^T) diag(exp(g_t)) S_{t-1} +
k_t (w_t ⊙ v_t)^T, o_t = scale S_t^T q_t.

The erase is not symmetric, so the transition diag(alpha_t) - k_t (b_t ⊙ k_t ⊙ alpha_t)^T is a general
diagonal-plus-rank-one matrix: every fast form is RWKV-7's op (kernels/wkv7: S_t = (diag(w) + b a^T) S_{t-1}
+ k v^T, o_t = S_t^T r) with w = alpha, b = k, a = -(b ⊙ k ⊙ alpha), v = w ⊙ v and r = scale q, which is
exact for any decay in its chunk, parallel and Pallas forms. mode "recurrent" and impl "reference" run
reference.py itself, so the tests of this folder check the mapping against the equations.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.gdn2.reference import gdn2_recurrent, gdn2_step
from kernels.wkv7 import wkv7


def gdn2(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
         g: Float[Array, "B T H K"], b: Float[Array, "B T H K"], w: Float[Array, "B T H V"], *,
         scale: float | None = None, segment_ids: Int[Array, "B T"] | None = None,
         initial_state: Float[Array, "B H K V"] | None = None, output_final_state: bool = False,
         mode: str = "chunk", chunk_size: int = 64, impl: str = "auto"):
    """Returns (o (B, T, H, V) in q's dtype, final state (B, H, K, V) float32 or None).

    g: log alpha <= 0 per key channel (not checked); b, w: the erase and write gates. scale None: K^-1/2.
    mode "recurrent" | "chunk" | "parallel", impl "auto" | "reference" | "xla" | "pallas" (kernels/wkv7);
    segment_ids / initial_state as every op (kernels/__init__.py).
    """
    check_mode(mode, chunk_size, "gdn2")
    check_impl(impl, "gdn2")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(segment_ids=segment_ids, initial_state=initial_state)
    if mode == "recurrent" or impl == "reference":
        o, S = gdn2_recurrent(q, k, v, g, b, w, scale=scale, **kwargs)
    else:
        g, k32 = g.astype(jnp.float32), k.astype(jnp.float32)
        a = -b.astype(jnp.float32) * k32 * jnp.exp(g)
        o, S = wkv7(q * scale, g, k32, (w * v).astype(v.dtype), a, k32, mode=mode, chunk_size=chunk_size,
                    impl=impl, output_final_state=True, **kwargs)
        o = o.astype(q.dtype)
    return o, (S if output_final_state else None)


__all__ = ["gdn2", "gdn2_step", "gdn2_recurrent"]
