"""WKV6 (RWKV-6) through the GLA Pallas kernels, by a shift of the inputs: kernels/gla/pallas.py
(Triton), or kernels/gla/pallas_tpu.py (Mosaic TPU) where kernels.pallas_platform() is "tpu" (on a
TPU, or ZOO_PALLAS_PLATFORM=tpu elsewhere).

WKV6 reads the state before the current token and adds the current token through the bonus u:

    o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),   S_t = diag(w_t) S_{t-1} + k_t v_t^T

GLA reads the state after it: o'_t = q_t^T S'_t, S'_t = diag(e^{g'_t}) S'_{t-1} + k'_t v'_t^T. With
the keys, values and log-decays shifted one token later, k'_t = k_{t-1}, v'_t = v_{t-1},
g'_t = log w_{t-1} (k'_0 = v'_0 = g'_0 = 0), S'_t = S_{t-1}, so

    o_t = GLA(r, k', v', g')_t + (r_t . u . k_t) v_t,    S_T = diag(w_{T-1}) S'_{T-1} + k_{T-1} v_{T-1}^T

Documents: GLA resets its state at a document start t; k'_t is zeroed there, so S'_t = 0 = S_{t-1}
after the reset, and the key of the previous document's last token is never added. Gradients flow
through GLA's custom_vjp and the XLA terms around it. The shift costs one copy of k, v and log w;
a dedicated WKV6 kernel would fold the bonus into GLA's diagonal instead.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import pallas_platform
from kernels.gla.pallas import gla_pallas
from kernels.gla.pallas_tpu import gla_pallas_tpu
from kernels.segments import document_starts


def wkv6_pallas(r: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                log_w: Float[Array, "B T H K"], u: Float[Array, "H K"], *,
                segment_ids: Int[Array, "B T"] | None = None, initial_state: Float[Array, "B H K V"] | None = None):
    """Same function as wkv6_recurrent. Returns (o (B, T, H, V) in r's dtype, S_T (B, H, K, V) float32)."""
    T = r.shape[1]
    shift = lambda x: jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :T]  # x'_t = x_{t-1}, x'_0 = 0
    k_prev, v_prev, g_prev = shift(k), shift(v), shift(log_w)
    if segment_ids is not None:
        k_prev = jnp.where(document_starts(segment_ids)[..., None, None], 0, k_prev)
    kernel = gla_pallas_tpu if pallas_platform() == "tpu" else gla_pallas
    o, S = kernel(r, k_prev, v_prev, g_prev, segment_ids=segment_ids, initial_state=initial_state)
    f32 = lambda x: x.astype(jnp.float32)
    bonus = jnp.einsum("bthk,hk,bthk->bth", f32(r), f32(u), f32(k))[..., None] * f32(v)  # (B, T, H, V)
    S = jnp.exp(f32(log_w[:, -1]))[..., None] * S + f32(k[:, -1])[..., None] * f32(v[:, -1])[..., None, :]
    return (f32(o) + bonus).astype(r.dtype), S
