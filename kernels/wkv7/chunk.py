"""WKV7 chunkwise-parallel form (plain JAX): exact for any T, via the WY/UT representation.

In the (K, V) state convention (see reference.py) the step is S_t = diag(w_t) S_{t-1} + b_t sa_t +
k_t v_t^T with sa_t = a_t^T S_{t-1}: a gated linear recurrence with a second key/value pair
(b_t, sa_t) whose "value" depends on the state. Inside a chunk of C tokens, with G_t = sum_{i<=t}
log w_i (G_{-1} = 0) and S_0 the state entering the chunk:

    sa_t = (a_t * e^{G_{t-1}})^T S_0 + sum_{s<t} A^ak_ts v_s^T + sum_{s<t} A^ab_ts sa_s
    A^ak_ts = sum_k a_tk k_sk e^{G_{t-1,k} - G_sk},  A^ab_ts = sum_k a_tk b_sk e^{G_{t-1,k} - G_sk}

so, stacking the chunk's rows, (I - A^ab) SA = (a * e^{G_-}) S_0 + A^ak V: a unit lower-triangular
system (the UT transform of the DPLR/WY papers; Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", and fla's chunk_dplr_delta_rule). Inverting
it once per chunk gives SA = W S_0 + U~ with W, U~ independent of S_0, so all chunks solve in
parallel and only the cheap state pass is sequential:

    SA   = W S_0 + U~
    S_C  = diag(e^{G_{C-1}}) S_0 + sum_s e^{G_{C-1} - G_s} * (k_s v_s^T + b_s sa_s)
    o_t  = (r_t * e^{G_t})^T S_0 + sum_{s<=t} (A^rk_ts v_s + A^rb_ts sa_s)      (inclusive: o reads S_t)

The scores use `decayed_scores` of kernels/decayed_chunks.py, as the WKV6 chunk form does (every
exponent <= 0 and summed over its exact interval: stable and precise for any decay), and document
resets are masks exactly as there (a reset zeroes S_{t-1}, hence sa_t's S_0 term and every
cross-document score). Padding uses zeros for r, k, v, a, b and log w = 0.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.decayed_chunks import chunk_inputs, cumsum_exclusive, decayed_scores, from_chunks
from kernels.linalg import unit_lower_inverse
from kernels.segments import entering_state


def wkv7_chunk(r: Float[Array, "B T H K"], w_log: Float[Array, "B T H K"], k: Float[Array, "B T H K"],
               v: Float[Array, "B T H V"], a: Float[Array, "B T H K"], b: Float[Array, "B T H K"], *,
               segment_ids: Int[Array, "B T"] | None = None,
               initial_state: Float[Array, "B H K V"] | None = None, chunk_size: int = 64,
               max_decay: float | None = None):
    """Returns (o (B, T, H, V) in r's dtype, S_T (B, H, K, V) float32). max_decay: decayed_scores'."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    xs = (r, w_log, k, v, a, b)  # each cut to (B, H, N, C, D), C capped at T rounded up to whole sub-chunks
    (rc, lw, kc, vc, ac, bc), (cont, same, last, carry) = chunk_inputs(xs, segment_ids, chunk_size)
    G = jnp.cumsum(lw, axis=-2)  # (B, H, N, C, K): G_t
    Gm = cumsum_exclusive(lw)  # G_{t-1}

    def scores(q, key, inclusive):  # (B, H, N, C, C)
        return decayed_scores(q, key, lw, inclusive=inclusive, max_decay=max_decay) * same
    A_ak, A_ab = scores(ac, kc, False), scores(ac, bc, False)  # sa_t reads S_{t-1}
    A_rk, A_rb = scores(rc, kc, True), scores(rc, bc, True)  # o_t reads S_t
    a_in = ac * jnp.exp(Gm) * cont[..., None]  # reads S_0 (sa_t)
    r_in = rc * jnp.exp(G) * cont[..., None]  # reads S_0 (o_t)
    tail = jnp.exp(cumsum_exclusive(lw, reverse=True)) * last[..., None]  # e^{G_{C-1} - G_s}, last document
    k_out, b_out = kc * tail, bc * tail  # write S_C
    g_end = jnp.exp(G[..., -1, :]) * carry[..., None]  # (B, H, N, K)

    # The UT transform: SA = W S_0 + U with W = (I - A^ab)^{-1} a_in, U = (I - A^ab)^{-1} A^ak V.
    inv = unit_lower_inverse(A_ab)  # (B, H, N, C, C)
    W = jnp.einsum("bhnts,bhnsk->bhntk", inv, a_in)
    U = jnp.einsum("bhnts,bhnsv->bhntv", inv, jnp.einsum("bhnts,bhnsv->bhntv", A_ak, vc))
    dS = jnp.einsum("bhnsk,bhnsv->bhnkv", k_out, vc)  # (B, H, N, K, V)

    def step(S, inp):
        g, w_, u_, bo, d = inp
        sa = jnp.einsum("bhck,bhkv->bhcv", w_, S) + u_  # (B, H, C, V)
        S_new = g[..., None] * S + d + jnp.einsum("bhck,bhcv->bhkv", bo, sa)
        return S_new, (S, sa)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (g_end, W, U, b_out, dS))
    S_T, (S_in, SA) = jax.lax.scan(step, entering_state(initial_state, (B, H, K, V)), xs)
    SA = jnp.moveaxis(SA, 0, 2)  # (B, H, N, C, V)
    o = (jnp.einsum("bhntk,nbhkv->bhntv", r_in, S_in) + jnp.einsum("bhnts,bhnsv->bhntv", A_rk, vc)
         + jnp.einsum("bhnts,bhnsv->bhntv", A_rb, SA))
    return from_chunks(o, T).astype(r.dtype), S_T
