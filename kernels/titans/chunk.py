"""Titans' linear memory in chunks (Behrouz et al. 2025, Section 3.2): the function of reference.py, a chunk of
C tokens (C = the mini-batch size) at a time by lax.scan, all tokens of a chunk in parallel. Inside a
mini-batch every gradient is taken at its start W_s, so the gradient terms are known up front and the surprise
and the memory are two linear recurrences with per-token decays. With a_t = 1 - alpha_t, e_t = eta_t and
g_l = -2 theta_l k_l^T r_l, r_l = k_l W_s - v_l (the residual at the token's anchor W_s), for tokens i >= l
of one document inside the chunk:

    A[i, l] = prod_{l < j <= i} a_j,   E[i, l] = prod_{l < j <= i} e_j,   Phi = A E   (C x C, lower triangular)
    S_i = E[i, -] S_in + sum_l E[i, l] g_l,    M_i = D_i M_in + A[i, :] E[:, -] S_in + sum_l Phi[i, l] g_l
    o_i = q_i M_i = D_i q_i M_in + phi_i q_i S_in - 2 sum_l Phi[i, l] theta_l (q_i . k_l) r_l

where "-" is the chunk's entry, D_i the decays from it (or from the document start, M_in = W_0 and S_in = 0
for a document that starts inside the chunk), and the products are exponentials of differences of cumulative
sums of the log gates (masked to one document: a document start cuts every product that crosses it).

Mini-batches follow each document's own positions, not the chunks, so, as kernels/ttt/dual.py, a chunk holds
at most three kinds of mini-batch, each with an anchor known before its gradients: "carried" (the scan's
W_s), "next" (the carried document's next mini-batch once the carried one ends inside the chunk: its anchor
is that token's M, computed from the carried tokens' gradients first) and "restarted" (after a document start
inside the chunk: W_0). T not a multiple of C: the last chunk is padded at its end and its carry taken at its
last real token (everything is causal, so the padding reaches no real token).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels.minibatches import by_kind, heads_in_chunks, in_chunks, last_tokens, layout, row_kinds
from kernels.titans.reference import entering_state


def decays(log_gate: Float[Array, "B H C"], mask: Bool[Array, "B C C"]) -> Float[Array, "B H C C"]:
    """prod_{l < j <= i} gate_j for (i, l) where mask holds (l <= i, one document), else 0."""
    c = jnp.cumsum(log_gate, axis=-1)
    diff = jnp.where(mask[:, None], c[..., :, None] - c[..., None, :], -jnp.inf)
    return jnp.exp(diff)


def chunk_gates(log_eta: Float[Array, "B H C"], log_decay: Float[Array, "B H C"], m: Int[Array, "B C"],
                st: Bool[Array, "B C"]):
    """A chunk's kinds of token and its decays (module docstring), from the log gates, the mini-batch numbers m
    and the document starts st: (restarted, carried, nxt (B, C); E, Phi (B, H, C, C); D, E_in, phi (B, H, C))."""
    C = m.shape[1]
    tril = jnp.tril(jnp.ones((C, C), bool))
    doc = jnp.cumsum(st, axis=1)  # (B, C): documents started in this chunk at or before the token
    same = tril & (doc[:, :, None] == doc[:, None, :])  # (B, C, C): l <= i in i's document
    restarted, carried, nxt = row_kinds(m, st)
    A, E = decays(log_decay, same), decays(log_eta, same)  # (B, H, C, C)
    Phi = jnp.einsum("bhij,bhjl->bhil", A, E)
    # decays from the chunk's entry (carried document) or from the document's start (W_0, S = 0)
    first = jnp.argmax(same, axis=2)  # (B, C): the first token of i's document in the chunk
    cx = jnp.cumsum(log_decay, axis=-1) - log_decay  # exclusive: D_i = exp(c_i - cx_first)
    D = jnp.exp(jnp.cumsum(log_decay, axis=-1) - jnp.take_along_axis(cx, first[:, None], axis=-1))  # (B, H, C)
    E_in = jnp.exp(jnp.cumsum(log_eta, axis=-1)) * ~restarted[:, None]  # (B, H, C): S_in -> S_i
    phi = jnp.einsum("bhij,bhj->bhi", A, E_in)  # S_in -> M_i
    return restarted, carried, nxt, E, Phi, D, E_in, phi


def titans_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                 theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"], log_decay: Float[Array, "B T H"],
                 W0: Float[Array, "H K V"], *, mini_batch_size: int, segment_ids: Int[Array, "B T"] | None = None,
                 initial_state: tuple | None = None):
    """Returns (o (B, T, H, V) in q's dtype, (W, M, S, pos)), as reference.py."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], mini_batch_size
    f32 = lambda a: a.astype(jnp.float32)
    W0 = f32(W0)
    W, M, S, pos0 = entering_state(initial_state, W0, B)
    starts, p, m = layout(segment_ids, B, T, C, pos0)  # (B, T): document starts, position and number of the mini-batch
    n = -(-T // C)
    heads = lambda a: heads_in_chunks(a, C)  # (n, B, H, C, ...)
    xs = (heads(q), heads(k), heads(v), heads(theta), heads(log_eta), heads(log_decay), in_chunks(p, C),
          in_chunks(m, C, -1), in_chunks(starts, C), last_tokens(T, C))
    apply = lambda x, W_: jnp.einsum("bhck,bhkv->bhcv", x, W_)  # (B, H, C, V)
    outer = lambda w, x, r: jnp.einsum("bhc,bhck,bhcv->bhkv", w, x, r)  # sum_c w_c x_c^T r_c: (B, H, K, V)
    W0b = jnp.broadcast_to(W0, (B, H, K, V))

    def body(carry, xs):
        W, M, S = carry
        q, k, v, theta, log_eta, log_decay, p, m, st, last = xs
        restarted, carried, nxt, E, Phi, D, E_in, phi = chunk_gates(log_eta, log_decay, m, st)
        col = lambda a: a[:, None, :, None]  # (B, C) -> (B, 1, C, 1)
        # the carried mini-batch first: its residuals, and the anchor of the next one should it end here
        R_c = apply(k, W) - v
        sel = (carried & (p == C - 1)).astype(jnp.float32)  # (B, C): the carried mini-batch's last token, if here
        w_n = -2.0 * theta * jnp.einsum("bi,bhil->bhl", sel, Phi)  # (B, H, C)
        at_sel = lambda a: jnp.einsum("bi,bhi->bh", sel, a)[..., None, None]  # (B, H, 1, 1)
        W_n = at_sel(D) * M + at_sel(phi) * S + outer(w_n, k, R_c)
        R = by_kind(carried, nxt, R_c, apply(k, W_n) - v, apply(k, W0b) - v)  # (B, H, C, V): k_l W_s - v_l, each anchor
        base = jnp.where(col(restarted), apply(q, W0b), apply(q, M))  # q_i M_in
        P = Phi * jnp.einsum("bhik,bhlk->bhil", q, k) * theta[:, :, None, :]  # (B, H, C, C)
        o = D[..., None] * base + phi[..., None] * apply(q, S) - 2.0 * jnp.einsum("bhil,bhlv->bhiv", P, R)
        # the carry: the last real token's memory, surprise and anchor (its memory if it ends a mini-batch)
        row = lambda a: jax.lax.dynamic_index_in_dim(a, last, axis=2, keepdims=False)  # token `last`'s row
        at = lambda a: jax.lax.dynamic_index_in_dim(a, last, axis=1, keepdims=False)  # (B, C) -> (B,)
        mat = lambda a: a[:, None, None, None]  # (B,) -> (B, 1, 1, 1)
        c_l, n_l, r_l = mat(at(carried)), mat(at(nxt)), mat(at(restarted))
        M_L = row(D)[..., None, None] * jnp.where(r_l, W0b, M) + row(phi)[..., None, None] * S \
            + outer(-2.0 * theta * row(Phi), k, R)  # phi, E_in are 0 after a restart: S_in = 0
        S_L = row(E_in)[..., None, None] * S + outer(-2.0 * theta * row(E), k, R)
        W_L = jnp.where(c_l, W, jnp.where(n_l, W_n, W0b))
        end = mat(at(p) == C - 1)
        return (jnp.where(end, M_L, W_L), M_L, S_L), o

    (W, M, S), o = jax.lax.scan(body, (W, M, S), xs)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, H, V)[:, :T]  # (n, B, H, C, V) -> (B, T, H, V)
    return o.astype(q.dtype), (W, M, S, (p[:, -1] + 1) % C)
