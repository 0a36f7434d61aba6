"""TTT-MLP's dual form (Sun et al. 2024, section 2.7, and the official `TTTMLP.process_mini_batch`): the function of
reference_mlp.py, a chunk of C tokens (C = the mini-batch size) at a time by lax.scan, all tokens of a chunk in
parallel, the weights never formed per token. Every gradient of a mini-batch is taken at its start theta_s, so
the rows' pre-activations Z1, the hidden X2 = gelu(Z1) and dl/dZ1, dl/dZ2 are known up front, and the query
reads each layer through kernels/inner_mlp.py's dual read, layer 1 first (its output is layer 2's input):

    Zb1_i = q_i W1_s + b1_s - a_{p_i} [ q_i G1 + g1 + sum_{j <= i, same mini-batch} eta_j (q_i . k_j + 1) dZ1_j ]
    Zb2_i = Xb2_i W2_s + b2_s - a_{p_i} [ Xb2_i G2 + g2 + sum_j eta_j (Xb2_i . X2_j + 1) dZ2_j ],  Xb2 = gelu(Zb1)
    o_i   = q_i + LN(Zb2_i)

(G1, g1, G2, g2: the sums carried in from an earlier call, zero unless the mini-batch began before it.)

The chunks are the call's and the mini-batches the documents', laid out as in dual.py (TTT-Linear): a chunk
holds at most a "carried" mini-batch (from the scan's carry), its "next" one (starting from theta_s - a_{C-1} G
once the carried one ends inside the chunk) and "restarted" ones (after a document start: the learned start);
each row's gradients are taken at its kind's start. The carry out is the start and sums of the last real
token's mini-batch, committed if that token is at p = C - 1; a padded last chunk has eta = 0 past T.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import inner_mlp
from kernels.minibatches import by_kind, heads_in_chunks, in_chunks, last_tokens, layout, row_kinds
from kernels.ttt.reference import layer_norm, loss_grad
from kernels.ttt.reference_mlp import EXACT_GELU, entering_state


def ttt_mlp_dual(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
                 eta: Float[Array, "B T H"], params0: tuple, ln_w: Float[Array, "H K"], ln_b: Float[Array, "H K"],
                 scale: Float[Array, " C"], *, segment_ids: Int[Array, "B T"] | None = None,
                 initial_state: tuple | None = None):
    """Returns (o (B, T, H, K) in q's dtype, (W1, b1, W2, b2, G1, g1, G2, g2, pos)), as reference_mlp.py."""
    B, T, H, K = q.shape
    C = scale.shape[0]
    f32 = lambda a: a.astype(jnp.float32)
    params0, ln_w, ln_b, scale = tuple(map(f32, params0)), f32(ln_w), f32(ln_b), f32(scale)
    state = entering_state(initial_state, params0, B)
    starts, p, m = layout(segment_ids, B, T, C, state[8])  # (B, T): document starts, position, mini-batch number
    n = -(-T // C)
    heads = lambda a: heads_in_chunks(a, C)  # (n, B, H, C, ...)
    xs = (heads(q), heads(k), heads(v), heads(eta), in_chunks(p, C), in_chunks(m, C, -1), in_chunks(starts, C),
          last_tokens(T, C))
    tril = jnp.tril(jnp.ones((C, C), bool))
    ln_w, ln_b = ln_w[:, None], ln_b[:, None]  # (H, 1, K): broadcast over a chunk's rows
    fresh = entering_state(None, params0, B)[:4]
    gelu = lambda z: inner_mlp.gelu(z, EXACT_GELU)

    def body(carry, xs):
        theta, G = carry[:4], carry[4:]
        q, k, v, eta, p, m, st, last = xs
        restarted, carried, nxt = row_kinds(m, st)  # (B, C)

        def rows_at(theta_a):  # every row's Z1, dl/dZ1, dl/dZ2 at the start(s) theta_a
            Z1, Z2 = inner_mlp.forward(k, theta_a, EXACT_GELU)
            dZ2 = loss_grad(Z2, ln_w, ln_b, jnp.broadcast_to(v - k, Z2.shape))
            return Z1, inner_mlp.backward(dZ2, Z1, theta_a[2], EXACT_GELU), dZ2

        # the carried mini-batch first: its gradients, and the start of the next one should it end here
        at_c = rows_at(theta)
        sums = inner_mlp.weighted_grads(eta * carried[:, None], k, *at_c, theta, EXACT_GELU)
        theta_n = tuple(t - scale[-1] * (g + s) for t, g, s in zip(theta, G, sums))
        # each row at its own kind's start: the three starts stacked on a leading axis, one picked per row
        starts3 = tuple(jnp.stack(t) for t in zip(theta, theta_n, fresh))  # (3, B, H, ...)
        kind = lambda a3: by_kind(carried, nxt, *a3)  # (3, B, H, C, F) -> (B, H, C, F)
        Z1, dZ1, dZ2 = map(kind, rows_at(starts3))  # (B, H, C, F | F | K)
        a = scale[p][:, None, :, None]  # (B, 1, C, 1): a_{p_i}
        P = a * eta[:, :, None, :] * (tril & (m[:, :, None] == m[:, None, :]))[:, None]  # (B, H, C, C)

        def read(x, i, Gw, gb):  # rows x through layer i at each row's start, less a_p (x G + g) where carried
            base = kind(inner_mlp.affine(x, starts3[i], starts3[i + 1]))
            return base - a * col(carried) * inner_mlp.affine(x, Gw, gb)

        col = lambda a: a[:, None, :, None]  # (B, C) -> (B, 1, C, 1)
        Zb1 = inner_mlp.dual_read(q, k, dZ1, P, read(q, 0, G[0], G[1]), bias=True)
        Xb2 = gelu(Zb1)
        Zb2 = inner_mlp.dual_read(Xb2, gelu(Z1), dZ2, P, read(Xb2, 2, G[2], G[3]), bias=True)
        o = q + layer_norm(Zb2, ln_w, ln_b)
        # the carry: the last real token's mini-batch, its start and sums, ended if it is at p = C - 1
        at = lambda x: jax.lax.dynamic_index_in_dim(x, last, axis=1, keepdims=False)  # (B, C) -> (B,)
        w_l = eta * ((jnp.arange(C) <= last) & (m == at(m)[:, None]))[:, None]  # (B, H, C)
        pick = lambda flag, x, y: jnp.where(flag.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
        c_l, n_l, end = at(carried), at(nxt), at(p) == C - 1
        sums = inner_mlp.weighted_grads(w_l, k, Z1, dZ1, dZ2, theta, EXACT_GELU)
        G = tuple(pick(c_l, g, 0.0) + s for g, s in zip(G, sums))
        theta = tuple(pick(c_l, t, pick(n_l, t_n, t_0)) for t, t_n, t_0 in zip(theta, theta_n, fresh))
        theta = tuple(pick(end, t - scale[-1] * g, t) for t, g in zip(theta, G))
        return (*theta, *(pick(end, jnp.zeros_like(g), g) for g in G)), o

    carry, o = jax.lax.scan(body, state[:8], xs)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, H, K)[:, :T]  # (n, B, H, C, K) -> (B, T, H, K)
    return o.astype(q.dtype), (*carry, (p[:, -1] + 1) % C)
