"""Titans' deep (two-layer MLP) memory in chunks (Behrouz et al. 2025, Section 3.2): the function of
reference_mlp.py, a chunk of C tokens (C = the mini-batch size) at a time by lax.scan, all tokens in parallel.

Every gradient of a mini-batch is taken at its start W_s, so each row's Z1 = k W1_s, X2 = gelu(Z1) and dl/dZ1,
dl/dZ2 are known up front, and each weight moves by the linear memory's recurrences (chunk.py: the decays A, E,
Phi = A E, D and phi from the chunk's entry, cut at document starts) driven by rank-one terms -theta_l X_l^T dZ_l:

    M1_i = D_i M1_in + phi_i S1_in - sum_l Phi[i, l] theta_l k_l^T dZ1_l          (the same for M2 with X2, dZ2)

so the query reads layer 1 through kernels/inner_mlp.py's dual read, and layer 2 the same with layer 1's output:

    Zb1_i = D_i q_i M1_in + phi_i q_i S1_in - sum_l Phi[i, l] theta_l (q_i . k_l) dZ1_l,    Xb2_i = gelu(Zb1_i)
    o_i   = D_i Xb2_i M2_in + phi_i Xb2_i S2_in - sum_l Phi[i, l] theta_l (Xb2_i . X2_l) dZ2_l

The chunks are the call's and the mini-batches the documents', as in chunk.py: a row's start is the scan's W_s
("carried"), the memory after the carried mini-batch's last token ("next") or the learned W_0 ("restarted").
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import inner_mlp
from kernels.minibatches import by_kind, heads_in_chunks, in_chunks, last_tokens, layout
from kernels.titans.chunk import chunk_gates
from kernels.titans.reference import entering_state
from kernels.titans.reference_mlp import EXACT_GELU, memory_rows, weight_terms


def titans_mlp_chunk(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                     theta: Float[Array, "B T H"], log_eta: Float[Array, "B T H"], log_decay: Float[Array, "B T H"],
                     W0: tuple, *, mini_batch_size: int, segment_ids: Int[Array, "B T"] | None = None,
                     initial_state: tuple | None = None):
    """Returns (o (B, T, H, V) in q's dtype, (W, M, S, pos)), as reference_mlp.py."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], mini_batch_size
    W, M, S, pos0 = entering_state(initial_state, W0, B)
    fresh = entering_state(None, W0, B)[0]
    starts, p, m = layout(segment_ids, B, T, C, pos0)  # (B, T): document starts, position, mini-batch number
    n = -(-T // C)
    heads = lambda a: heads_in_chunks(a, C)  # (n, B, H, C, ...)
    xs = (heads(q), heads(k), heads(v), heads(theta), heads(log_eta), heads(log_decay), in_chunks(p, C),
          in_chunks(m, C, -1), in_chunks(starts, C), last_tokens(T, C))
    gelu = lambda z: inner_mlp.gelu(z, EXACT_GELU)

    def body(carry, xs):
        W, M, S = carry
        q, k, v, theta, log_eta, log_decay, p, m, st, last = xs
        restarted, carried, nxt, E, Phi, D, E_in, phi = chunk_gates(log_eta, log_decay, m, st)
        mat = lambda a: a[..., None, None]  # (B, H) -> (B, H, 1, 1)
        # the carried mini-batch first: the anchor of the next one (the memory at its last token, if here)
        sel = (carried & (p == C - 1)).astype(jnp.float32)  # (B, C)
        at_sel = lambda a: mat(jnp.einsum("bi,bhi->bh", sel, a))
        terms = weight_terms(-theta * jnp.einsum("bi,bhil->bhl", sel, Phi), k, memory_rows(k, v, W))
        W_n = tuple(at_sel(D) * m_ + at_sel(phi) * s + g for m_, s, g in zip(M, S, terms))
        # each row at its own kind's anchor: the three stacked on a leading axis, one picked per row
        W3 = tuple(jnp.stack(w) for w in zip(W, W_n, fresh))  # (3, B, H, ...)
        rows = tuple(by_kind(carried, nxt, *a3) for a3 in memory_rows(k, v, W3))  # Z1, dZ1, dZ2 (B, H, C, .)
        col = lambda a: a[:, None, :, None]  # (B, C) -> (B, 1, C, 1)
        P = Phi * theta[:, :, None, :]  # (B, H, C, C): Phi[i, l] theta_l
        base = lambda x, i: D[..., None] * jnp.where(col(restarted), x @ fresh[i], x @ M[i]) \
            + phi[..., None] * (x @ S[i])  # (B, H, C, .): D_i x_i M_in + phi_i x_i S_in
        Xb2 = gelu(inner_mlp.dual_read(q, k, rows[1], P, base(q, 0), bias=False))
        o = inner_mlp.dual_read(Xb2, gelu(rows[0]), rows[2], P, base(Xb2, 1), bias=False)
        # the carry: the last real token's memory, surprise and anchor (its memory if it ends a mini-batch)
        row = lambda a: jax.lax.dynamic_index_in_dim(a, last, axis=2, keepdims=False)  # token `last`'s row
        at = lambda a: jax.lax.dynamic_index_in_dim(a, last, axis=1, keepdims=False)  # (B, C) -> (B,)
        flag = lambda a: at(a)[:, None, None, None]  # (B, 1, 1, 1)
        M_in = tuple(jnp.where(flag(restarted), w0, m_) for w0, m_ in zip(fresh, M))
        M_L = tuple(mat(row(D)) * m_ + mat(row(phi)) * s + g for m_, s, g in
                    zip(M_in, S, weight_terms(-theta * row(Phi), k, rows)))  # phi, E_in are 0 after a restart
        S_L = tuple(mat(row(E_in)) * s + g for s, g in zip(S, weight_terms(-theta * row(E), k, rows)))
        W_L = tuple(jnp.where(flag(carried), w, jnp.where(flag(nxt), w_n, w0)) for w, w_n, w0 in zip(W, W_n, fresh))
        end = flag(p == C - 1)
        return (tuple(jnp.where(end, a, b) for a, b in zip(M_L, W_L)), M_L, S_L), o

    (W, M, S), o = jax.lax.scan(body, (W, M, S), xs)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, H, V)[:, :T]  # (n, B, H, C, V) -> (B, T, H, V)
    return o.astype(q.dtype), (W, M, S, (p[:, -1] + 1) % C)
