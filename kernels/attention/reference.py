"""Reference softmax attention (Vaswani et al., 2017) with the masks the zoo needs.

    o_i = sum_j softmax_j(q_i . k_j * scale + decay_i - kv_decay_j + mask_ij) v_j

mask_ij is 0 where key j is visible from query i, -inf elsewhere: causal (p_j <= p_i), sliding
window (p_j > p_i - window, so a query sees `window` keys including itself) and segments (same
segment id). Grouped-query attention (Ainslie et al., 2023) reshapes the H query heads into G groups
of R = H / G that share one kv head; K/V are never repeated in memory. Logits, softmax and the
weighted sum accumulate in float32; a query that sees no key returns zeros. This is the truth the
fast forms (xla.py, the Pallas kernels) are tested against: it materialises the (T, S) scores and
autodiff differentiates its masked softmax as written.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def attention_reference(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G V"],
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, "#B T"] | None = None,  # rows of 1 broadcast
    kv_positions: Int[Array, "#B S"] | None = None,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    decay: Float[Array, "B T H"] | None = None,
    kv_decay: Float[Array, "B S H"] | None = None,
) -> Float[Array, "B T H V"]:
    B, T, H, K = q.shape
    S, G = k.shape[1], k.shape[2]
    scale = K ** -0.5 if scale is None else scale
    qg = q.reshape(B, T, G, H // G, K)  # (B, T, G, R, K)
    s = jnp.einsum("BTGRK,BSGK->BGRTS", qg, k, preferred_element_type=jnp.float32) * scale
    if decay is not None:
        s = s + decay_bias(decay, decay if kv_decay is None else kv_decay, G)
    qp, kp = default_positions(T, S, q_positions, kv_positions)
    mask = visible(qp, kp, segment_ids, kv_segment_ids, causal, window)[:, None, None]  # (B|1, 1, 1, T, S)
    s = jnp.where(mask, s, -jnp.inf)
    # The shift cancels in the softmax, so no gradient goes through it (through the max of a row with -inf
    # entries and a decay, XLA on CPU at the tests' optimisation level returned NaN gradients).
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("BGRTS,BSGV->BTGRV", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def heads_first_decay(decay: Float[Array, "B T H"], G: int) -> Float[Array, "B G R T"]:
    """A decay (B, T, H) in the layout of the logits, the R query heads of each kv head together."""
    B, T, H = decay.shape
    return decay.astype(jnp.float32).reshape(B, T, G, H // G).transpose(0, 2, 3, 1)  # (B, G, R, T)


def decay_bias(decay: Float[Array, "B T H"], kv_decay: Float[Array, "B S H"], G: int) -> Float[Array, "B G R T S"]:
    """decay_i - kv_decay_j, the logits' bias (module docstring)."""
    return heads_first_decay(decay, G)[..., :, None] - heads_first_decay(kv_decay, G)[..., None, :]


def default_positions(T: int, S: int, q_positions, kv_positions):
    """(B|1, T) query and (B|1, S) key positions; by default the T queries are the last T of the S keys."""
    qp = jnp.arange(S - T, S, dtype=jnp.int32)[None] if q_positions is None else q_positions
    kp = jnp.arange(S, dtype=jnp.int32)[None] if kv_positions is None else kv_positions
    return qp, kp


def visible(qp: Int[Array, "#B T"], kp: Int[Array, "#B S"], segment_ids: Int[Array, "B T"] | None,
            kv_segment_ids: Int[Array, "B S"] | None, causal: bool, window: int | None) -> Bool[Array, "#B T S"]:
    """True where query i may see key j: causal (p_j <= p_i), inside the window (p_j > p_i - window),
    the same segment (kv_segment_ids default to segment_ids)."""
    mask = jnp.ones((1, qp.shape[1], kp.shape[1]), bool)
    if causal:
        mask = mask & (kp[:, None, :] <= qp[:, :, None])
    if window is not None:
        mask = mask & (kp[:, None, :] > qp[:, :, None] - window)
    if segment_ids is not None:
        kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (kv_seg[:, None, :] == segment_ids[:, :, None])
    return mask
