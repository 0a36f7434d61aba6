"""TTT-Linear token mixer (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States",
arXiv 2407.04620), as the official JAX code's `TTTLinear` (test-time-training/ttt-lm-jax) computes it. Per head
the hidden state is a linear inner model, trained on the document as it is read by one step of gradient descent
per mini-batch of C tokens (kernels/ttt has the inner loop, its state and its dual form):

    x_qk = theta_Q x,  q = conv_q(x_qk),  k = conv_k(x_qk),  v = theta_V x       (causal depthwise convs)
    q, k <- RoPE(q, k) at the position p_t in the mini-batch (0 .. C - 1)
    eta_t = base_lr sigmoid(theta_lr x_t) / K   per head;  a_p = max(1 / (p + 1) + learned_p, 0)
    z_t = q_t + LN(q_t W_t + b_t),  W_t, b_t from 1/2 |LN(k W + b) - (v - k)|^2 (kernels/ttt/reference.py)
    y_t = W_o [ gelu(W_g x_t) * LayerNorm(z_t) ]        (the post-norm over all heads, then the output gate)

Code names: `num_heads` H, head_dim K = d_model / H; `mini_batch_size` C; `q_proj` theta_Q (shared by q and k,
as the official code), `q_conv`, `k_conv`, `v_proj` theta_V, `lr_proj` theta_lr (one logit per head, a bias),
`token_idx` the learned offsets of a_p (C,), `W0`, `b0` the inner model's learned start (H, K, K), (H, K),
`ttt_norm_w`, `ttt_norm_b` the inner LayerNorm (H, K), `post_norm`, `g_proj` W_g, `o_proj` W_o.
Decode state: the current mini-batch's start W_s, b_s, its gradient sums G, g (float32), the next token's
position in it (B,) int32, and the one window of the two convolutions (both read x_qk).

TTT-MLP (`TTTMLP`, the official `TTTMLP`) is the same layer with the inner model a two-layer MLP of hidden width
F = 4 K, f(x) = gelu(x W1 + b1) W2 + b2 (tanh-approximate gelu, as flax's), read as q + LN(f(q)) and trained on
1/2 |LN(f(k)) - (v - k)|^2 (kernels/ttt/reference_mlp.py); `W1`, `b1`, `W2`, `b2` its learned start (H, K, F),
(H, F), (H, F, K), (H, K), normal(0.02) weights and zero biases as the official. `TTTMixer` holds everything
the two share (projections, convs, RoPE, learning rates, norms, state layout, documents, rollback); a subclass
names its inner model's parameters, its op and its state.

Departures from the official code, named: its blocks add a `pre_conv` residual convolution before the mixer's
norm (a block-level change outside a mixer: left out); its sequence length must be a multiple of the
mini-batch, here any T (a trailing partial mini-batch is just unfinished, as decoding leaves it); mini-batches
follow each document's own positions, restarting at W0, b0 at every document start (the official code has no
packing); RoPE pairs channels (i, i + K/2) as layers/rotary.py, not (2i, 2i+1) (a fixed permutation of q and
k channels); initialisation: the zoo's Linear and ShortConvolution defaults for the projections and convs (the
official: normal(0.02) and flax's Conv), theta_lr normal(0.02) with a zero bias and W0 normal(0.02), b0 zero as
the official; no `ttt_lr_mult` warm-up of the inner learning rate, no remat.
"""

import dataclasses
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels.segments import positions_in_document
from kernels.ttt import MODES, ttt_linear, ttt_mlp
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import LayerNorm
from layers.options import OneOf, PosFloat, PosInt
from layers.rotary import apply_rotary
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class TTTState:
    W: Float[Array, "B H K K"]  # (B, H, K, K) float32: the current mini-batch's start W_s
    b: Float[Array, "B H K"]  # (B, H, K) float32: its b_s
    gW: Float[Array, "B H K K"]  # (B, H, K, K) float32: G, the eta-weighted gradient sum so far in the mini-batch
    gb: Float[Array, "B H K"]  # (B, H, K) float32: g, the same for b
    pos: Int[Array, " B"]  # (B,) int32: the next token's position in its mini-batch
    conv: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K): the window of x_qk


@state
class TTTMLPState:
    W1: Float[Array, "B H K F"]  # (B, H, K, F) float32: the current mini-batch's start of W1
    b1: Float[Array, "B H F"]  # (B, H, F) float32: of b1
    W2: Float[Array, "B H F K"]  # (B, H, F, K) float32: of W2
    b2: Float[Array, "B H K"]  # (B, H, K) float32: of b2
    gW1: Float[Array, "B H K F"]  # (B, H, K, F) float32: the eta-weighted gradient sums so far in the mini-batch
    gb1: Float[Array, "B H F"]  # (B, H, F) float32
    gW2: Float[Array, "B H F K"]  # (B, H, F, K) float32
    gb2: Float[Array, "B H K"]  # (B, H, K) float32
    pos: Int[Array, " B"]  # (B,) int32: the next token's position in its mini-batch
    conv: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K): the window of x_qk


class TTTMixer(SequenceMixer):
    """The layer TTT-Linear and TTT-MLP share (module docstring); a subclass sets `State` and `op` and writes
    `_init_inner` (its inner model's learned start) and `inner_start` (those parameters in the op's order)."""

    State, op = None, None

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, mini_batch_size: PosInt = 16,
                 base_lr: PosFloat = 1.0, conv_size: PosInt = 4, rope_base: PosFloat = 10000.0,
                 norm_eps: PosFloat = 1e-6, mode: Annotated[str, OneOf(*MODES)] = "chunk",
                 impl: Annotated[str, OneOf("auto", "reference", "xla")] = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
        if (d_model // num_heads) % 2:
            raise ValueError(f"num_heads={num_heads} gives an odd head_dim {d_model // num_heads}; RoPE needs it even")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        if impl not in ("auto", "reference", "xla"):
            raise ValueError(f"impl={impl!r}; expected one of 'auto', 'reference', 'xla' (no Pallas kernel)")
        H, K = num_heads, d_model // num_heads
        self.d_model, self.num_heads, self.head_dim, self.mini_batch_size = d_model, H, K, mini_batch_size
        self.base_lr, self.rope_base = base_lr, rope_base
        self.mode, self.impl, self.dtype = mode, impl, dtype
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.q_proj, self.v_proj, self.g_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, H * K)
        self.q_conv, self.k_conv = (ShortConvolution(H * K, conv_size, activation=False, use_bias=True, rngs=rngs)
                                    for _ in range(2))
        normal = nnx.initializers.normal(0.02)
        self.lr_proj = Linear(d_model, H, use_bias=True, dtype=dtype, rngs=rngs, kernel_init=normal,
                              kernel_metadata=axes("embed", None))
        self.token_idx = nnx.Param(jnp.zeros((mini_batch_size,), jnp.float32))
        self._init_inner(H, K, normal, rngs)
        self.ttt_norm_w = nnx.Param(jnp.ones((H, K), jnp.float32), **axes("heads", None))
        self.ttt_norm_b = nnx.Param(jnp.zeros((H, K), jnp.float32), **axes("heads", None))
        self.post_norm = LayerNorm(H * K, eps=norm_eps)
        self.o_proj = linear(H * K, d_model, ROWS)

    def init_state(self, batch_size: int, max_len: int = 0):
        """The inner model's learned start at position 0; max_len is accepted and ignored (the state does not
        grow)."""
        start = tuple(jnp.broadcast_to(a, (batch_size, *a.shape)) for a in self.inner_start())
        return self.State(*start, *map(jnp.zeros_like, start), jnp.zeros((batch_size,), jnp.int32),
                          self.q_conv.init_state(batch_size, self.dtype))

    def _mix(self, x, state, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H, K, C = self.num_heads, self.head_dim, self.mini_batch_size
        x = x.astype(self.dtype)
        x_qk = self.q_proj(x)
        q, _ = self.q_conv.decode(x_qk, state.conv, segment_ids=segment_ids)
        k, window = self.k_conv.decode(x_qk, state.conv, segment_ids=segment_ids, steps=steps)
        p = positions_in_document(segment_ids, B, T, start=state.pos) % C  # (B, T): RoPE's position
        q, k = (apply_rotary(a.reshape(B, T, H, K), p, self.rope_base) for a in (q, k))  # (B, T, H, K)
        v = self.v_proj(x).reshape(B, T, H, K)  # (B, T, H, K)
        eta = self.base_lr / K * jax.nn.sigmoid(self.lr_proj(x).astype(jnp.float32))  # (B, T, H)
        scale = jnp.maximum(1.0 / jnp.arange(1, C + 1, dtype=jnp.float32) + self.token_idx[...], 0.0)
        params = (*self.inner_start(), self.ttt_norm_w[...], self.ttt_norm_b[...], scale)
        op = lambda S, q, k, v, eta: type(self).op(q, k, v, eta, *params, segment_ids=segment_ids, initial_state=S,
                                                   output_final_state=True, mode=mode, impl=self.impl)
        fields = dataclasses.fields(state)[:-1]  # all but the conv window: the op's state, in its order
        args = (tuple(getattr(state, f.name) for f in fields), q, k, v, eta)
        z, S = stepwise(op, *args) if steps else op(*args)  # z: (B, T, H, K)
        z = self.post_norm(z.reshape(B, T, H * K))  # (B, T, H*K): one norm over all heads
        y = self.o_proj(jax.nn.gelu(self.g_proj(x)) * z)
        return y, (self.State.stepped if steps else self.State)(*S, window)


class TTTLinear(TTTMixer):
    """TTT-Linear (Sun et al. 2024): per head a linear inner model W, b trained while reading, one gradient step
    per mini_batch_size tokens on the reconstruction 1/2 |LN(k W + b) - (v - k)|^2, output q + LN(q W_t + b_t),
    then a LayerNorm, a gelu output gate and the output projection; num_heads must divide d_model; base_lr: the
    inner learning rate's scale (eta = base_lr sigmoid(.) / head_dim); conv_size: the causal convs on q and k;
    rope_base: RoPE over the position in the mini-batch; norm_eps: the post-norm's (the inner LayerNorm's is
    1e-6, as the official); mode ("recurrent" | "chunk") picks the training path's exact form (chunk: the dual
    form); impl ("auto" | "reference" | "xla"); dtype: the compute dtype (parameters stay float32)."""

    State, op = TTTState, staticmethod(ttt_linear)

    def _init_inner(self, H: int, K: int, normal, rngs: nnx.Rngs):
        self.W0 = nnx.Param(normal(rngs.params(), (H, K, K), jnp.float32), **axes("heads", None, None))
        self.b0 = nnx.Param(jnp.zeros((H, K), jnp.float32), **axes("heads", None))

    def inner_start(self) -> tuple:
        return self.W0[...], self.b0[...]


class TTTMLP(TTTMixer):
    """TTT-MLP (Sun et al. 2024): TTT-Linear (its options and its layer) with the inner model a two-layer MLP,
    f(x) = gelu(x W1 + b1) W2 + b2 of hidden width 4 head_dim per head, trained while reading, one gradient step
    per mini_batch_size tokens on 1/2 |LN(f(k)) - (v - k)|^2, output q + LN(f_t(q)); num_heads must divide
    d_model (an even head_dim, for RoPE); base_lr, conv_size, rope_base, norm_eps, mode ("recurrent" | "chunk":
    the dual form), impl ("auto" | "reference" | "xla") and dtype as TTTLinear's."""

    State, op = TTTMLPState, staticmethod(ttt_mlp)
    hidden_ratio = 4  # F = 4 K, the official code's

    def _init_inner(self, H: int, K: int, normal, rngs: nnx.Rngs):
        F = self.hidden_ratio * K
        self.W1 = nnx.Param(normal(rngs.params(), (H, K, F), jnp.float32), **axes("heads", None, None))
        self.b1 = nnx.Param(jnp.zeros((H, F), jnp.float32), **axes("heads", None))
        self.W2 = nnx.Param(normal(rngs.params(), (H, F, K), jnp.float32), **axes("heads", None, None))
        self.b2 = nnx.Param(jnp.zeros((H, K), jnp.float32), **axes("heads", None))

    def inner_start(self) -> tuple:
        return self.W1[...], self.b1[...], self.W2[...], self.b2[...]
