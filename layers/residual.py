"""Residual connections beyond x + f(x): manifold-constrained hyper-connections and attention residuals.

A pre-norm block adds each sublayer's output to one residual stream, x <- x + f(norm(x)). The two
connections here replace that sum; each wraps one sublayer (a mixer or an FFN, with its own norm
inside f) as `connection(stream, f) -> (stream, aux)`, where f(h) -> (y, aux) runs the sublayer on
its input h of shape (B, T, D). Both act on each token alone, across depth: a decode state is
untouched and decoding T tokens equals the full pass.

mHC (Xie et al. 2025, "mHC: Manifold-Constrained Hyper-Connections", arXiv 2512.24880; built on
Zhu et al. 2024, "Hyper-Connections", arXiv 2409.19606). The stream is n copies, X in R^{n x D},
and sublayer l reads and writes it as (Eq. 3)

    x_in = H_pre X                  (1 x n)       X <- H_res X + H_post^T f(x_in)
    x'   = vec(X) / rms(vec(X))                    (the stream flattened to nD, RMS-normalised)
    H_pre  = sigmoid(a_pre  x' phi_pre  + b_pre)                       (Eqs. 7, 8)
    H_post = 2 sigmoid(a_post x' phi_post + b_post)
    H_res  = SinkhornKnopp(a_res mat(x' phi_res) + b_res)   (doubly stochastic, Eq. 9: M = exp(.),
             then `iterations` rounds of normalising the rows, then the columns)

with the dynamic parts from the normalised stream and the static biases b. The embedding enters as
n copies; the final norm reads the sum of the n streams (Hyper-Connections' read-out).

AttnRes (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031). Each sublayer l reads a softmax
mixture over depth instead of the running sum (Eqs. 2-4):

    h_l = sum_i a_{i->l} v_i,    a_{i->l} = softmax_i(w_l . RMSNorm(v_i)),    v_0 = the embedding

where v_i (i >= 1) is sublayer i's output (Full AttnRes) and w_l a learned pseudo-query, zero at
start (uniform weights). Block AttnRes (Eqs. 5, 6) closes a block every `block_size` sublayers: the
values are the embedding, each closed block's sum of outputs and the open block's partial sum;
block_size 1 is Full AttnRes. A last read with its own query gives the final norm's input.

Code names: X `stream` (B, T, n, D); n `rate`; phi `phi` (nD, 2n + n^2: pre, post, res columns);
a `alpha` (3: pre, post, res); b `bias` (2n + n^2, flat); w_l `query`; RMSNorm of the keys
`key_norm`; the AttnRes stream (closed blocks, open partial sum) `(blocks, partial)`.

Choices and departures:
- mHC's RMSNorm of vec(X) has no gain (a gain folds into phi; the paper's kernel normalises after
  the matmul); the sublayer's own pre-norm is applied to x_in inside f, as in a pre-norm block.
- mHC's initial values, which the paper does not give in full, follow Hyper-Connections' pre-norm-like
  start: phi = 0, alpha = 0.01 (the paper's gating-factor init), b_pre +8 on stream l mod n and -8
  elsewhere (sublayer l reads one stream, H_pre ~ e_{l mod n}), b_post 0 (H_post = 1 on every stream),
  b_res 0 on the diagonal and -2 off it (H_res = 0.71 on the diagonal, 0.10 off it: near the identity,
  yet far enough from a permutation that 20 rounds of Sinkhorn-Knopp converge; near a permutation
  they converge slowly, the gap mHC-lite, arXiv 2601.05732, points out). The n copies start equal and
  a doubly stochastic H_res keeps equal copies equal, so at the start the model is a pre-norm residual
  whatever H_res is. With n = 1, H_res = 1 and H_post = 1 exactly and H_pre = sigmoid(8): after the
  sublayer's norm the block is the standard residual up to the norm's eps.
- Sinkhorn-Knopp runs a fixed `iterations` (paper: 20) in the log domain: the paper's iterates,
  without exp's underflow (a row or column of zeros, 0/0) once the logits spread in training. The
  columns are normalised last, so they sum to 1 exactly, the rows to 1 within what the rounds reach
  (1e-7 near the start; 1e-4 or worse for logits far apart).
- "Layer" in both papers is one sublayer (attention or FFN): each has its own connection.
- AttnRes: the keys' RMSNorm has a gain (the paper counts one RMSNorm per layer); the softmax and
  the mixture are computed in float32.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from layers.norm import RMSNorm

STREAM = ("batch", None, None, None)  # mHC's (B, T, n, D): rows over the batch axes


def sinkhorn_knopp(logits: Float[Array, "... n n"], iterations: int) -> Float[Array, "... n n"]:
    """The doubly stochastic matrix of exp(logits): rows then columns normalised, `iterations` times, in
    the log domain (the same iterates; an entry far below its row's or column's cannot underflow to 0/0)."""
    def normalise(_, m):
        m = m - jax.nn.logsumexp(m, axis=-1, keepdims=True)  # rows
        return m - jax.nn.logsumexp(m, axis=-2, keepdims=True)  # columns

    return jnp.exp(jax.lax.fori_loop(0, iterations, normalise, logits.astype(jnp.float32)))


class HyperConnection(nnx.Module):
    """mHC around sublayer `index` (its start reads stream index mod rate): (X, f) -> (X, aux)."""

    def __init__(self, d_model: int, rate: int = 4, *, index: int = 0, iterations: int = 20, eps: float = 1e-6):
        n = rate
        self.rate, self.iterations, self.eps = rate, iterations, eps
        self.phi = nnx.Param(jnp.zeros((n * d_model, 2 * n + n * n), jnp.float32), axes=("embed", None))
        self.alpha = nnx.Param(jnp.full((3,), 0.01, jnp.float32), axes=(None,))
        b_pre = jnp.where(jnp.arange(n) == index % n, 8.0, -8.0)
        b_res = jnp.where(jnp.eye(n, dtype=bool), 0.0, -2.0).reshape(n * n)
        self.bias = nnx.Param(jnp.concatenate([b_pre, jnp.zeros((n,)), b_res]).astype(jnp.float32), axes=(None,))

    def coefficients(self, stream: Float[Array, "B T n D"]):
        """H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n), in float32."""
        B, T, n, D = stream.shape
        x = stream.reshape(B, T, n * D).astype(jnp.float32)  # (B, T, nD)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        z = x @ self.phi[...]  # (B, T, 2n + n^2)
        a, b = self.alpha[...], self.bias[...]
        pre = jax.nn.sigmoid(a[0] * z[..., :n] + b[:n])
        post = 2 * jax.nn.sigmoid(a[1] * z[..., n:2 * n] + b[n:2 * n])
        res = sinkhorn_knopp((a[2] * z[..., 2 * n:] + b[2 * n:]).reshape(B, T, n, n), self.iterations)  # (B, T, n, n)
        return pre, post, res

    def __call__(self, stream: Float[Array, "B T n D"], f):
        pre, post, res = self.coefficients(stream)
        x = stream.astype(jnp.float32)
        y, aux = f(jnp.einsum("btn,btnd->btd", pre, x).astype(stream.dtype))
        out = jnp.einsum("btij,btjd->btid", res, x) + post[..., None] * y.astype(jnp.float32)[:, :, None]
        return out.astype(stream.dtype), aux


def widen(x: Float[Array, "B T D"], rate: int) -> Float[Array, "B T n D"]:
    """mHC's entry: n copies of the embedding."""
    return jnp.broadcast_to(x[:, :, None], (*x.shape[:2], rate, x.shape[-1]))  # (B, T, n, D)


def narrow(stream: Float[Array, "B T n D"]) -> Float[Array, "B T D"]:
    """mHC's read-out for the final norm: the sum of the n streams."""
    return jnp.sum(stream.astype(jnp.float32), axis=2).astype(stream.dtype)


class DepthAttention(nnx.Module):
    """One AttnRes read: softmax(w . RMSNorm(v_i)) over the sources v_i, mixing the raw v_i."""

    def __init__(self, d_model: int, *, eps: float = 1e-6):
        self.query = nnx.Param(jnp.zeros((d_model,), jnp.float32), axes=(None,))  # w_l: uniform weights at start
        self.key_norm = RMSNorm(d_model, eps=eps)

    def __call__(self, sources: tuple) -> Float[Array, "B T D"]:
        v = jnp.stack(sources).astype(jnp.float32)  # (S, B, T, D)
        weights = jax.nn.softmax(self.key_norm(v) @ self.query[...], axis=0)  # (S, B, T)
        return jnp.einsum("sbt,sbtd->btd", weights, v).astype(sources[-1].dtype)


class AttentionResidual(nnx.Module):
    """AttnRes around sublayer `index`: ((blocks, partial), f) -> ((blocks, partial), aux). The sublayer
    reads the closed blocks and the open partial sum; every `block_size` sublayers (from sublayer 0,
    which so closes the embedding as the first source) the partial sum closes into a block."""

    def __init__(self, d_model: int, *, index: int = 0, block_size: int = 1, eps: float = 1e-6):
        self.read = DepthAttention(d_model, eps=eps)
        self.closes = index % block_size == 0

    def __call__(self, stream: tuple, f):
        blocks, partial = stream
        h = self.read((*blocks, partial))
        if self.closes:
            blocks, partial = (*blocks, partial), None
        y, aux = f(h)
        return (blocks, y if partial is None else partial + y), aux


def start(x: Float[Array, "B T D"]) -> tuple:
    """AttnRes's entry: no closed block yet, the embedding as the open one."""
    return (), x
