"""TTT-Linear's inner loop (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
States", arXiv 2407.04620), token by token in float32: the truth for the dual form (dual.py).

Per head the hidden state is the inner model f(x) = x W + b (W (K, K), b (K,)), trained online on a
self-supervised reconstruction loss by gradient descent in mini-batches of C tokens. Token t sits at position
p_t in its mini-batch (0 <= p_t < C) and every token of a mini-batch takes its gradient at the W_s, b_s the
mini-batch started from:

    l_t(W, b)  = 1/2 || LN(k_t W + b) - (v_t - k_t) ||^2           (LN: per-head LayerNorm, weight w, bias c)
    G_t        = sum_{s <= t, s in t's mini-batch} eta_s grad_{W} l_s(W_s, b_s)     (the same for b: g_t)
    W_t        = W_s - a_{p_t} G_t,    b_t = b_s - a_{p_t} g_t
    o_t        = q_t + LN(q_t W_t + b_t)
    at p_t = C - 1 the mini-batch ends: W_s, b_s <- W_t, b_t and G, g <- 0.

eta_t is the per-token learning rate (the layer's base_lr sigmoid(theta_lr x_t) / K) and a_p the per-position
factor (the official `token_idx`: 1 / (p + 1) plus a learned offset, clipped at 0), so the update at a
mini-batch's end is the learning-rate-weighted mean of its gradients. The gradient through LN is written out:
with z = k W + b, x_hat = (z - mean z) / sigma, sigma = sqrt(var z + eps), e = w (LN(z) - y):

    dl/dz = (e - mean(e) - x_hat mean(e x_hat)) / sigma,   grad_W l = k^T dl/dz,   grad_b l = dl/dz.

Packed documents: a document start (segment_ids) restarts from the learned W_0, b_0 with G = g = 0 and p = 0,
so a document's mini-batches line up with its own positions, as if it ran alone. Token 0 of a call continues
`initial_state` = (W_s, b_s, G, g, p) (kernels/__init__.py), which may stop mid-mini-batch: its p says where.

Code names: `W`, `b` the mini-batch's start W_s, b_s (B, H, K, K), (B, H, K); `gW`, `gb` G and g; `pos` p
(B,) int32, the next token's position; `eta` (B, T, H); `scale` a (C,), its length the mini-batch size C;
`W0`, `b0` (H, K, K), (H, K); `ln_w`, `ln_b` the inner LayerNorm's w and c (H, K).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import scan_documents

EPS = 1e-6  # flax LayerNorm's default, the official code's inner norm


def layer_norm(z: Float[Array, "*B K"], w, c) -> Float[Array, "*B K"]:
    mu = jnp.mean(z, axis=-1, keepdims=True)
    x_hat = (z - mu) * jax.lax.rsqrt(jnp.var(z, axis=-1, keepdims=True) + EPS)
    return w * x_hat + c


def loss_grad(z: Float[Array, "*B K"], w, c, target: Float[Array, "*B K"]) -> Float[Array, "*B K"]:
    """dl/dz of l = 1/2 |LN(z) - target|^2 (module docstring)."""
    mu = jnp.mean(z, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.var(z, axis=-1, keepdims=True) + EPS)
    x_hat = (z - mu) * inv
    e = w * (w * x_hat + c - target)
    mean = lambda a: jnp.mean(a, axis=-1, keepdims=True)
    return (e - mean(e) - x_hat * mean(e * x_hat)) * inv


def entering_state(initial_state: tuple | None, W0: Float[Array, "H K K"], b0: Float[Array, "H K"], batch: int):
    """(W, b, gW, gb, pos) before token 0 in float32 (pos int32): `initial_state`, or W0, b0 at position 0."""
    if initial_state is not None:
        W, b, gW, gb, pos = initial_state
        f32 = lambda a: a.astype(jnp.float32)
        return f32(W), f32(b), f32(gW), f32(gb), pos.astype(jnp.int32)
    W = jnp.broadcast_to(W0.astype(jnp.float32), (batch, *W0.shape))
    b = jnp.broadcast_to(b0.astype(jnp.float32), (batch, *b0.shape))
    return W, b, jnp.zeros_like(W), jnp.zeros_like(b), jnp.zeros((batch,), jnp.int32)


def ttt_linear_step(state: tuple, q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H K"],
                    eta: Float[Array, "B H"], scale: Float[Array, " C"], ln_w: Float[Array, "H K"],
                    ln_b: Float[Array, "H K"]):
    """One token from (W_s, b_s, G, g, p): returns (o_t (B, H, K), the state after it), float32."""
    W, b, gW, gb, pos = state
    dz = loss_grad(jnp.einsum("bhi,bhij->bhj", k, W) + b, ln_w, ln_b, v - k)  # (B, H, K)
    gW = gW + eta[..., None, None] * k[..., :, None] * dz[..., None, :]  # eta_t grad_W l_t(W_s): k^T dl/dz
    gb = gb + eta[..., None] * dz
    a = scale[pos][:, None, None]  # (B, 1, 1): a_{p_t}
    W_t, b_t = W - a[..., None] * gW, b - a * gb
    o = q + layer_norm(jnp.einsum("bhi,bhij->bhj", q, W_t) + b_t, ln_w, ln_b)
    end = pos == scale.shape[0] - 1  # the mini-batch's last token: W_t, b_t start the next one
    pick = lambda x, y: jnp.where(end.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
    zero = lambda a: pick(jnp.zeros_like(a), a)
    return o, (pick(W_t, W), pick(b_t, b), zero(gW), zero(gb), jnp.where(end, 0, pos + 1))


def ttt_linear_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H K"],
                         eta: Float[Array, "B T H"], W0: Float[Array, "H K K"], b0: Float[Array, "H K"],
                         ln_w: Float[Array, "H K"], ln_b: Float[Array, "H K"], scale: Float[Array, " C"], *,
                         segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Scan of `ttt_linear_step` over time, a document start restarting from (W0, b0, 0, 0, 0). Returns
    (o (B, T, H, K) in q's dtype, (W, b, gW, gb, pos))."""
    B = q.shape[0]
    f32 = lambda a: a.astype(jnp.float32)
    W0, b0, ln_w, ln_b, scale = map(f32, (W0, b0, ln_w, ln_b, scale))
    step_t = lambda S, *x_t: ttt_linear_step(S, *x_t, scale, ln_w, ln_b)
    xs = (f32(q), f32(k), f32(v), f32(eta))
    o, S = scan_documents(step_t, entering_state(initial_state, W0, b0, B), xs, segment_ids,
                          fresh=entering_state(None, W0, b0, B))
    return o.astype(q.dtype), S  # (B, T, H, K)
