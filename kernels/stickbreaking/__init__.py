"""Stick-breaking attention (Tan et al., 2025, arXiv:2410.17980): one entry point, the form picked by `impl`.

    z_ij = q_i . k_j * scale,  β_ij = σ(z_ij),  A_ij = β_ij Π_{j < l < i} (1 - β_il),  o_i = Σ_j A_ij v_j

with r_i = Π_j (1 - β_ij) = 1 - Σ_j A_ij, the stick left over (reference.py has the symbols). No softmax
and no normalisation: a query's weights sum to at most 1, and to 0 where it sees no key.

Which keys a query sees: key j strictly before query i (j < i, the paper's and flash-linear-attention's
default, attend_current=False) and in its document. Keys are at positions 0..S-1 (a KV cache's slots);
queries at `q_positions` (B, T), by default the last T of the S keys. Key j is seen by query i iff
j < q_positions[i] and kv_segment_ids[j] == segment_ids[i] (kv_segment_ids defaults to segment_ids, for
T = S). A key of another document is left out of both the weights and the product, so it takes no share
and breaks no stick: a packed document gets exactly the weights it gets alone (flash-linear-attention's
varlen form runs each document alone, the same thing).

- "reference": reference.py, one query at a time, the product over later keys written out;
- "xla" / "auto": xla.py, the dense masked (T, S) form with a reverse cumulative sum.
There is no Pallas kernel (impl="pallas" is refused): the official Triton kernels are a flash-style
blocked form, and the dense form is what this zoo runs on every backend for now.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.stickbreaking.reference import stickbreaking_reference
from kernels.stickbreaking.xla import stickbreaking_xla

__all__ = ["stickbreaking", "stickbreaking_reference", "stickbreaking_xla"]


def stickbreaking(q: Float[Array, "B T H K"], k: Float[Array, "B _ _ K"], v: Float[Array, "B _ _ V"], *,
                  segment_ids: Int[Array, "B T"] | None = None, kv_segment_ids: Int[Array, "B S"] | None = None,
                  q_positions: Int[Array, "B T"] | None = None, scale: float | None = None, impl: str = "auto",
                  kv_heads_first: bool = False) -> tuple[Float[Array, "B T H V"], Float[Array, "B T H"]]:
    """Returns (o (B, T, H, V) in q's dtype, r (B, T, H) float32). G kv heads divide the H query heads (GQA);
    k, v are (B, G, S, K|V) with kv_heads_first (a KV cache's layout). scale None means K^-1/2."""
    check_no_pallas(impl, "stickbreaking")
    B, T, H, K = q.shape
    G, S = (k.shape[1], k.shape[2]) if kv_heads_first else (k.shape[2], k.shape[1])
    if H % G:
        raise ValueError(f"stickbreaking: {G} kv heads do not divide {H} query heads")
    if segment_ids is None and kv_segment_ids is not None:
        raise ValueError("stickbreaking: kv_segment_ids without segment_ids (the queries' documents)")
    if segment_ids is not None and kv_segment_ids is None:
        if S != T:
            raise ValueError(f"stickbreaking: segment_ids of {T} queries against {S} keys need kv_segment_ids")
        kv_segment_ids = segment_ids
    scale = K ** -0.5 if scale is None else scale
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))
    seen = jnp.arange(S, dtype=jnp.int32)[None, None] < q_positions[:, :, None]  # (B, T, S): j < i
    if segment_ids is not None:
        seen = seen & (kv_segment_ids[:, None, :] == segment_ids[:, :, None])
    if impl == "reference":
        ks, vs = (a.transpose(0, 2, 1, 3) for a in (k, v)) if kv_heads_first else (k, v)  # (B, S, G, K|V)
        o, r = stickbreaking_reference(q, ks, vs, seen, scale)
    else:
        o, r = stickbreaking_xla(q, k, v, seen, scale, kv_heads_first)
    return o.astype(q.dtype), r
