"""TTT-MLP's inner loop (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
arXiv 2407.04620), token by token in float32: the truth for its dual form (dual_mlp.py).

As TTT-Linear (reference.py: the loss, the mini-batch rule, the state's layout, packed documents), with the
inner model a two-layer MLP of hidden width F (4 K in the official code) in place of x W + b:

    f(x)       = gelu(x W1 + b1) W2 + b2                        (gelu: the tanh approximation, as flax's)
    l_t(theta) = 1/2 || LN(f(k_t)) - (v_t - k_t) ||^2           theta = (W1, b1, W2, b2)
    G_t        = sum_{s <= t, s in t's mini-batch} eta_s grad l_s(theta_s)     (one sum per parameter)
    theta_t    = theta_s - a_{p_t} G_t
    o_t        = q_t + LN(f_{theta_t}(q_t))
    at p_t = C - 1 the mini-batch ends: theta_s <- theta_t and G <- 0.

The gradients through the MLP are kernels/inner_mlp.py's backward pass from dl/dZ2 (reference.py's loss_grad
through the LayerNorm). The official code's LN(.) + residual (its output q + LN(f(q)), its target v - k) is
that of TTT-Linear; only f differs.

Code names: the state (W1 (B, H, K, F), b1 (B, H, F), W2 (B, H, F, K), b2 (B, H, K), G1, g1, G2, g2 the
eta-weighted gradient sums of each, pos (B,) int32); `params0` the learned start (W1, b1, W2, b2) without B;
`eta`, `scale`, `ln_w`, `ln_b` as reference.py.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import inner_mlp
from kernels.segments import scan_documents
from kernels.ttt.reference import layer_norm, loss_grad

EXACT_GELU = False  # the official code's flax nn.gelu: the tanh approximation


def entering_state(initial_state: tuple | None, params0: tuple, batch: int) -> tuple:
    """(*theta_s, *G, pos) before token 0 in float32 (pos int32): `initial_state`, or params0 at position 0."""
    if initial_state is not None:
        return (*(a.astype(jnp.float32) for a in initial_state[:-1]), initial_state[-1].astype(jnp.int32))
    theta = tuple(jnp.broadcast_to(a.astype(jnp.float32), (batch, *a.shape)) for a in params0)
    return (*theta, *map(jnp.zeros_like, theta), jnp.zeros((batch,), jnp.int32))


def ttt_mlp_step(state: tuple, q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H K"],
                 eta: Float[Array, "B H"], scale: Float[Array, " C"], ln_w: Float[Array, "H K"],
                 ln_b: Float[Array, "H K"]):
    """One token from (theta_s, G, p): returns (o_t (B, H, K), the state after it), float32."""
    theta, G, pos = state[:4], state[4:8], state[8]
    row = lambda a: a[:, :, None]  # (B, H, 1, K): one row
    Z1, Z2 = inner_mlp.forward(row(k), theta, EXACT_GELU)
    dZ2 = loss_grad(Z2, ln_w[:, None], ln_b[:, None], row(v - k))  # (B, H, 1, K)
    dZ1 = inner_mlp.backward(dZ2, Z1, theta[2], EXACT_GELU)
    grads = inner_mlp.weighted_grads(eta[..., None], row(k), Z1, dZ1, dZ2, theta, EXACT_GELU)  # eta_t grad l_t
    G = tuple(g + d for g, d in zip(G, grads))
    a = scale[pos]  # (B,): a_{p_t}
    at = lambda x: a.reshape((-1,) + (1,) * (x.ndim - 1))
    theta_t = tuple(w - at(g) * g for w, g in zip(theta, G))
    o = q + layer_norm(inner_mlp.forward(row(q), theta_t, EXACT_GELU)[1][:, :, 0], ln_w, ln_b)
    end = pos == scale.shape[0] - 1  # the mini-batch's last token: theta_t starts the next one
    pick = lambda x, y: jnp.where(end.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
    theta = tuple(map(pick, theta_t, theta))
    G = tuple(pick(jnp.zeros_like(g), g) for g in G)
    return o, (*theta, *G, jnp.where(end, 0, pos + 1))


def ttt_mlp_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
                      eta: Float[Array, "B T H"], params0: tuple, ln_w: Float[Array, "H K"],
                      ln_b: Float[Array, "H K"], scale: Float[Array, " C"], *,
                      segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Scan of `ttt_mlp_step` over time, a document start restarting from (params0, 0, 0). Returns
    (o (B, T, H, K) in q's dtype, (W1, b1, W2, b2, G1, g1, G2, g2, pos))."""
    B = q.shape[0]
    f32 = lambda a: a.astype(jnp.float32)
    params0, ln_w, ln_b, scale = tuple(map(f32, params0)), f32(ln_w), f32(ln_b), f32(scale)
    step_t = lambda S, *x_t: ttt_mlp_step(S, *x_t, scale, ln_w, ln_b)
    xs = (f32(q), f32(k), f32(v), f32(eta))
    o, S = scan_documents(step_t, entering_state(initial_state, params0, B), xs, segment_ids,
                          fresh=entering_state(None, params0, B))
    return o.astype(q.dtype), S  # (B, T, H, K)
