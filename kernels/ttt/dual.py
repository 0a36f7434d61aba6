"""TTT-Linear's dual form (Sun et al. 2024, section 2.7 and appendix A): the function of reference.py, a chunk of C
tokens (C = the mini-batch size) at a time by lax.scan, all tokens of a chunk in parallel, G never summed per
token. For token i of a mini-batch that started from W_s, b_s (with G_s, g_s already summed before this call
chunk, zero unless the mini-batch began in an earlier chunk) and d_j = dl_j/dz at W_s, b_s:

    q_i W_i + b_i = q_i W_s + b_s - a_{p_i} [ q_i G_s + g_s + sum_{j <= i, same mini-batch} eta_j (q_i . k_j + 1) d_j ]

(q_i G_t = sum_j eta_j (q_i . k_j) d_j: a masked C x C product instead of K x K per token.)

Mini-batches line up with document positions, not with chunks, so the chunks are the call's and each token is
told its position p (reference.py) and its mini-batch's number m (a running count of mini-batch starts). A
chunk of C tokens then holds at most three kinds of mini-batch, each with a start known before its gradients:
- "carried": the chunk's first mini-batch when no document starts at or before the token: it started from the
  scan's carry (W_s, b_s, G_s, g_s);
- "next": the carried document's next mini-batch, once the carried one ends inside the chunk: it starts from
  W_s - a_{C-1} G (G summed over the carried one), computed from the carried tokens' gradients first;
- "restarted": a mini-batch at or after a document start inside the chunk: it starts from W_0, b_0.
A mini-batch that begins inside a chunk has fewer than C tokens there, so it cannot end before the chunk's last
token: these three are all. The carry out is the start and sums of the chunk's last real token's mini-batch,
ended (committed) if that token is at p = C - 1. T not a multiple of C: the last chunk is padded at its end
with eta = 0 and its carry taken at its last real token.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.minibatches import by_kind, heads_in_chunks, in_chunks, last_tokens, layout, row_kinds
from kernels.ttt.reference import entering_state, layer_norm, loss_grad


def ttt_linear_dual(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
                    eta: Float[Array, "B T H"], W0: Float[Array, "H K K"], b0: Float[Array, "H K"],
                    ln_w: Float[Array, "H K"], ln_b: Float[Array, "H K"], scale: Float[Array, " C"], *,
                    segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Returns (o (B, T, H, K) in q's dtype, (W, b, gW, gb, pos)), as reference.py."""
    B, T, H, K = q.shape
    C = scale.shape[0]
    f32 = lambda a: a.astype(jnp.float32)
    W0, b0, ln_w, ln_b, scale = map(f32, (W0, b0, ln_w, ln_b, scale))
    W, b, gW, gb, pos0 = entering_state(initial_state, W0, b0, B)
    starts, p, m = layout(segment_ids, B, T, C, pos0)  # (B, T): document starts, position and number of the mini-batch
    n = -(-T // C)
    heads = lambda a: heads_in_chunks(a, C)  # (n, B, H, C, ...)
    xs = (heads(q), heads(k), heads(v), heads(eta), in_chunks(p, C), in_chunks(m, C, -1), in_chunks(starts, C),
          last_tokens(T, C))
    tril = jnp.tril(jnp.ones((C, C), bool))
    ln = lambda z: layer_norm(z, ln_w[:, None], ln_b[:, None])
    grad = lambda z, q_, k_, v_: loss_grad(z, ln_w[:, None], ln_b[:, None], v_ - k_)
    apply = lambda x, W_, b_: jnp.einsum("bhck,bhkj->bhcj", x, W_) + b_[:, :, None]  # (B, H, C, K)
    outer = lambda w, x, d: jnp.einsum("bhc,bhck,bhcj->bhkj", w, x, d)  # sum_c w_c x_c^T d_c: (B, H, K, K)
    W0b, b0b = jnp.broadcast_to(W0, (B, H, K, K)), jnp.broadcast_to(b0, (B, H, K))

    def body(carry, xs):
        W, b, gW, gb = carry
        q, k, v, eta, p, m, st, last = xs
        restarted, carried, nxt = row_kinds(m, st)  # (B, C)
        # the carried mini-batch first: its gradients, and the start of the next one should it end here
        d_c = grad(apply(k, W, b), q, k, v)
        w_c = eta * carried[:, None]  # (B, H, C)
        W_n = W - scale[-1] * (gW + outer(w_c, k, d_c))
        b_n = b - scale[-1] * (gb + jnp.einsum("bhc,bhcj->bhj", w_c, d_c))
        d = grad(by_kind(carried, nxt, apply(k, W, b), apply(k, W_n, b_n), apply(k, W0b, b0b)), q, k, v)  # (B, H, C, K)
        same = tril & (m[:, :, None] == m[:, None, :])  # (B, C, C): j <= i in i's mini-batch
        A = (jnp.einsum("bhik,bhjk->bhij", q, k) + 1) * eta[:, :, None, :] * same[:, None]  # (B, H, C, C)
        sums = jnp.einsum("bhij,bhjk->bhik", A, d) + carried[:, None, :, None] * apply(q, gW, gb)
        z = by_kind(carried, nxt, apply(q, W, b), apply(q, W_n, b_n), apply(q, W0b, b0b)) \
            - scale[p][:, None, :, None] * sums
        o = q + ln(z)
        # the carry: the last real token's mini-batch, its start and sums, ended if it is at p = C - 1
        at = lambda a: jax.lax.dynamic_index_in_dim(a, last, axis=1, keepdims=False)  # (B,)
        w_l = eta * ((jnp.arange(C) <= last) & (m == at(m)[:, None]))[:, None]  # (B, H, C)
        c_l, n_l = at(carried)[:, None, None], at(nxt)[:, None, None]
        G = jnp.where(c_l[..., None], gW, 0.0) + outer(w_l, k, d)
        g = jnp.where(c_l, gb, 0.0) + jnp.einsum("bhc,bhcj->bhj", w_l, d)
        W_s = jnp.where(c_l[..., None], W, jnp.where(n_l[..., None], W_n, W0b))
        b_s = jnp.where(c_l, b, jnp.where(n_l, b_n, b0b))
        end = (at(p) == C - 1)[:, None, None]
        carry = (jnp.where(end[..., None], W_s - scale[-1] * G, W_s), jnp.where(end, b_s - scale[-1] * g, b_s),
                 jnp.where(end[..., None], 0.0, G), jnp.where(end, 0.0, g))
        return carry, o

    (W, b, gW, gb), o = jax.lax.scan(body, (W, b, gW, gb), xs)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, H, K)[:, :T]  # (n, B, H, C, K) -> (B, T, H, K)
    return o.astype(q.dtype), (W, b, gW, gb, (p[:, -1] + 1) % C)
