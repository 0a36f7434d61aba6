"""Reference PaTH attention (Yang, Wang, Zhang, Shen, Kim, Panda, 2025, "PaTH Attention: Position Encoding via
Accumulating Householder Transformations", arXiv:2505.16381), in float32, written like the paper's equations.

Each token t brings a generalised Householder matrix H_t = I - β_t w_t w_t^T (|w_t| = 1, 0 < β_t < 2), and the
logit of query i against key j <= i of its document is

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j          (no factor for j = i)
    o_i  = Σ_j softmax_j(scale * (s_ij + c_i - c_j)) v_j

with c the cumulative log forget gate (FoX's, optional). Two forms, each one token at a time:

- `path_reference`: one query at a time, which walks back over the keys from its own, scoring key j with the
  query as it stands and then applying H_j to it (H symmetric: q^T H_i ... H_{j+1} = (H_{j+1} ... H_i q)^T).
  O(T^2 K); the truth every other form is tested against.
- `path_decode_reference`: the paper's decoding, a cache of keys each already carried through the factors of
  the tokens after it: a new token t applies its H_t to every cached key of its document (k_j <- H_t k_j),
  writes its own key, and its query attends over the cache as in plain softmax attention. O(S K) a token.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _softmax_out(logits, seen, axis=-1):
    """softmax over the seen entries (max trick, float32) of `logits`, as weights."""
    logits = jnp.where(seen, logits, -jnp.inf)
    m = jnp.max(logits, axis=axis, keepdims=True)
    p = jnp.where(seen, jnp.exp(logits - m), 0.0)
    return p / jnp.sum(p, axis=axis, keepdims=True)


def path_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                   w: Float[Array, "B T G K"], beta: Float[Array, "B T G"], doc: Int[Array, "B T"],
                   decay: Float[Array, "B T H"] | None, scale: float) -> Float[Array, "B T H V"]:
    """o (B, T, H, V) float32; doc: the document number of each token (a query sees keys of its own)."""
    B, T, H, K = q.shape
    G = k.shape[2]
    R = H // G
    q = q.astype(jnp.float32).reshape(B, T, G, R, K)  # (B, T, G, R, K)
    k, v, w, beta = (a.astype(jnp.float32) for a in (k, v, w, beta))
    c = jnp.zeros((B, T, G, R), jnp.float32) if decay is None else decay.astype(jnp.float32).reshape(B, T, G, R)

    def one_query(i):
        def back(q_t, j):  # keys j = T-1, ..., 0; only j <= i of i's document count
            seen = (j <= i) & (doc[:, j] == doc[:, i])  # (B,)
            s = jnp.einsum("bgrk,bgk->bgr", q_t, k[:, j])  # q_i^T H_i ... H_{j+1} k_j
            wq = jnp.einsum("bgrk,bgk->bgr", q_t, w[:, j])
            step = jnp.where(seen[:, None, None], beta[:, j, :, None] * wq, 0.0)  # H_j q_t = q_t - β_j (w_j.q_t) w_j
            return q_t - step[..., None] * w[:, j, :, None, :], (s, seen)

        _, (s, seen) = jax.lax.scan(back, q[:, i], jnp.arange(T - 1, -1, -1))  # (T, B, G, R), (T, B): keys reversed
        s, seen = s[::-1], seen[::-1]
        logits = scale * (s + c[:, i][None] - jnp.moveaxis(c, 1, 0))  # (T, B, G, R)
        p = _softmax_out(logits, seen[:, :, None, None], axis=0)
        return jnp.einsum("jbgr,bjgv->bgrv", p, v).reshape(B, H, -1)  # (B, H, V)

    o = jax.lax.map(one_query, jnp.arange(T))  # (T, B, H, V)
    return jnp.moveaxis(o, 0, 1)


def path_decode_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                          w: Float[Array, "B T G K"], beta: Float[Array, "B T G"], doc: Int[Array, "B T"],
                          decay: Float[Array, "B T H"] | None, slots, index: Int[Array, " B"], scale: float):
    """The T tokens after each row's `index` cached tokens, one at a time: (o (B, T, H, V) float32, slots after),
    `slots` a kernels.path.PathSlots (k, v (B, G, S, K|V), doc (B, S), decay (B, H, S) or None)."""
    B, T, H, _ = q.shape
    G, S = slots.k.shape[1:3]
    R = H // G
    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    state = (f32(slots.k), f32(slots.v), slots.doc, f32(slots.decay))
    slot = jnp.arange(S)

    def token(state, xs):
        sk, sv, sdoc, sc = state
        q_t, k_t, v_t, w_t, b_t, d_t, c_t, t = xs  # (B, H, K), (B, G, K), ..., (B, G), (B,), (B, H) or None, ()
        p = index + t  # (B,): the token's slot
        mine = (slot[None] < p[:, None]) & (sdoc == d_t[:, None])  # (B, S): cached keys of its document
        wk = jnp.einsum("bgsk,bgk->bgs", sk, w_t)
        sk = sk - jnp.where(mine[:, None], b_t[..., None] * wk, 0.0)[..., None] * w_t[:, :, None]  # k_j <- H_t k_j
        at = (slot[None] == p[:, None])  # (B, S)
        sk = jnp.where(at[:, None, :, None], k_t[:, :, None], sk)
        sv = jnp.where(at[:, None, :, None], v_t[:, :, None], sv)
        sdoc = jnp.where(at, d_t[:, None], sdoc)
        seen = (slot[None] <= p[:, None]) & (sdoc == d_t[:, None])  # (B, S)
        s = jnp.einsum("bgrk,bgsk->bgrs", q_t.reshape(B, G, R, -1), sk)  # (B, G, R, S)
        if sc is not None:
            sc = jnp.where(at[:, None], c_t[..., None], sc)
            s = s + (c_t[..., None] - sc).reshape(B, G, R, S)
        pr = _softmax_out(scale * s, seen[:, None, None])
        o = jnp.einsum("bgrs,bgsv->bgrv", pr, sv).reshape(B, H, -1)  # (B, H, V)
        return (sk, sv, sdoc, sc), o

    xs = tuple(None if a is None else jnp.moveaxis(f32(a) if a.dtype != jnp.int32 else a, 1, 0)
               for a in (q, k, v, w, beta, doc, decay)) + (jnp.arange(T),)  # (T, B, ...)
    (sk, sv, sdoc, sc), o = jax.lax.scan(token, state, xs)
    new = type(slots)(k=sk.astype(slots.k.dtype), v=sv.astype(slots.v.dtype), doc=sdoc,
                      decay=None if sc is None else sc.astype(slots.decay.dtype))
    return jnp.moveaxis(o, 0, 1), new
