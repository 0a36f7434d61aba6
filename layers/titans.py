"""Titans' neural memory as a token mixer (Behrouz, Zhong & Mirrokni 2025, "Titans: Learning to Memorize at Test
Time", arXiv 2501.00663), the paper's "memory as a layer" (MAL) with the linear memory M(k) = k M (or, with
memory_depth 2, the deep memory below). Per head the memory is a matrix trained while the layer reads, by
gradient descent with momentum and forgetting on the associative loss ||k_t M - v_t||^2, the gradients of a
mini-batch of C tokens all taken at its start (the paper's parallel training, Section 3.2; kernels/titans has
the inner loop, its state and its chunk form):

    q = L2(SiLU(conv_q(W_q x))),  k = L2(SiLU(conv_k(W_k x))),  v = SiLU(conv_v(W_v x))  (causal depthwise convs)
    theta_t = max_lr sigmoid(w_theta x_t + b_theta) / K,  eta_t = sigmoid(w_eta x_t + b_eta),
    alpha_t = sigmoid(w_alpha x_t + b_alpha)                                        (one of each per head)
    S_t = eta_t S_{t-1} - theta_t grad l(W_s; x_t),   M_t = (1 - alpha_t) M_{t-1} + S_t,   o_t = q_t M_t
    y_t = W_o [ RMSNorm(o_t) * SiLU(W_g x_t) ]        (per-head norm; RMSNorm alone without the output gate)

Code names: `num_heads` H, head_dim K = d_model / H (the memory is K x K per head); `mini_batch_size` C (the
paper's b); `q_proj`, `k_proj`, `v_proj` W_q, W_k, W_v and `q_conv`, `k_conv`, `v_conv` their convolutions;
`gate_proj` the three gate logits per head (theta, eta, alpha) with their biases; `max_lr` theta's ceiling;
`W0` the memory's learned start (H, K, K); `o_norm`, `g_proj` W_g, `o_proj` W_o. Decode state: the current
mini-batch's start W_s, the memory M and the surprise S after the last token (B, H, K, K) float32, the next
token's position in the mini-batch (B,) int32, and the three convolutions' windows.

Deep memory (memory_depth 2; the paper's L_M >= 2, Section 3.1): the memory is titans-pytorch's `MemoryMLP` of
depth 2, M(k) = gelu(k M1) M2 with M1 (K, F), M2 (F, K), F = 4 K (its NeuralMemory default), no biases, the erf
GELU, each weight trained by the same momentum and forgetting (kernels/titans/reference_mlp.py); `W1`, `W2` its
learned start, Xavier-uniform per head. Its decode state is the pair of each of W_s, M and S (TitansMLPState).

Departures, named: memory depth 1 or 2 only (the paper allows any L_M >= 1); the gates are per token (the paper
allows per token or per chunk; titans-pytorch computes eta and alpha per chunk from the chunk's mean input); o_t
reads M_t, the memory after the token's own in-mini-batch update, as the paper's equations (titans-pytorch reads
the memory as of the end of the previous chunk); no LayerNorm + residual around the memory model (titans-pytorch's
default, from TTT) and no pre-norm inside the layer (the zoo's block has one); the loss is titans-pytorch's mean over
the K channels (theta / K in the sum's gradient; the paper writes the sum, whose K times larger steps
overflowed the trained memory past about 1,600 tokens); mini-batches follow each document's own positions, restarting at
W0 at every document start (neither has packing); any T (a trailing partial mini-batch is unfinished, as decoding
leaves it); initialisation: the zoo's Linear and ShortConvolution defaults, W0 Xavier-uniform per head as
titans-pytorch's memory weights, gate biases 0 for theta and eta and -4 for alpha (alpha ~ 0.02: little forgetting
at the start; neither source fixes them); max_lr 0.1, titans-pytorch's (configs/titans.yaml after 250 steps:
1.792 nats/byte).
Past the trained length the memory stays finite but stops helping: configs/titans.yaml after 250 steps of 128
tokens reads 1.79 nats/byte up to about 300 tokens, then climbs to a plateau near 4.0 from about 1,000 tokens to
4,096 (docs/experiments.md).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels.titans import MODES, titans
from layers.conv import ShortConvolution, convolve, init_windows
from layers.deltanet import normalize_qk
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm, RMSNorm
from layers.options import OneOf, PosFloat, PosInt, Range
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise

ALPHA_BIAS = -4.0  # the forgetting gate's initial logit


@state
class TitansState:
    W: Float[Array, "B H K K"]  # (B, H, K, K) float32: the current mini-batch's start W_s (its gradients' anchor)
    M: Float[Array, "B H K K"]  # (B, H, K, K) float32: the memory after the last token
    S: Float[Array, "B H K K"]  # (B, H, K, K) float32: the surprise (momentum) after the last token
    pos: Int[Array, " B"]  # (B,) int32: the next token's position in its mini-batch
    conv_q: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)
    conv_k: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)


@state
class TitansMLPState:
    W1: Float[Array, "B H K F"]  # (B, H, K, F) float32: the current mini-batch's start of M1
    W2: Float[Array, "B H F K"]  # (B, H, F, K) float32: of M2
    M1: Float[Array, "B H K F"]  # (B, H, K, F) float32: the memory's first layer after the last token
    M2: Float[Array, "B H F K"]  # (B, H, F, K) float32: its second
    S1: Float[Array, "B H K F"]  # (B, H, K, F) float32: the surprise of M1 after the last token
    S2: Float[Array, "B H F K"]  # (B, H, F, K) float32: of M2
    pos: Int[Array, " B"]  # (B,) int32: the next token's position in its mini-batch
    conv_q: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)
    conv_k: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)


class TitansMemory(SequenceMixer):
    """Titans' neural memory (Behrouz et al. 2025), memory as a layer: per head a K x K linear memory trained while
    reading on ||k M - v||^2 by gradient descent with momentum eta_t and forgetting alpha_t, the gradients of each
    mini_batch_size tokens taken at the mini-batch's start; output q M_t, a per-head RMSNorm, a SiLU output gate
    (use_output_gate) and the output projection; num_heads must divide d_model; max_lr: the inner learning rate's
    ceiling (theta = max_lr sigmoid(.) / head_dim); conv_size: the short convolutions on q, k, v; norm_eps: the output
    norm's; memory_depth: 1 the linear memory, 2 a two-layer MLP memory gelu(k M1) M2 of hidden width
    4 head_dim; mode ("recurrent" | "chunk") picks the training path's exact form; impl ("auto" | "reference" |
    "xla"); dtype: the compute dtype (parameters stay float32)."""

    hidden_ratio = 4  # the deep memory's F = 4 K, titans-pytorch's default

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, mini_batch_size: PosInt = 16, max_lr: PosFloat = 0.1,
                 conv_size: PosInt = 4, use_output_gate: bool = True, norm_eps: PosFloat = 1e-5,
                 memory_depth: Annotated[int, Range(1, 2)] = 1, mode: Annotated[str, OneOf(*MODES)] = "chunk",
                 impl: Annotated[str, OneOf("auto", "reference", "xla")] = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size={mini_batch_size} must be >= 1")
        if conv_size < 1:
            raise ValueError(f"conv_size={conv_size} must be >= 1")
        if memory_depth not in (1, 2):
            raise ValueError(f"memory_depth={memory_depth!r}; expected 1 (linear) or 2 (a two-layer MLP)")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        if impl not in ("auto", "reference", "xla"):
            raise ValueError(f"impl={impl!r}; expected one of 'auto', 'reference', 'xla' (no Pallas kernel)")
        H, K = num_heads, d_model // num_heads
        self.memory_depth = memory_depth
        self.d_model, self.num_heads, self.head_dim, self.mini_batch_size = d_model, H, K, mini_batch_size
        self.max_lr, self.mode, self.impl, self.dtype = max_lr, mode, impl, dtype
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.q_proj, self.k_proj, self.v_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, H * K)
        self.q_conv, self.k_conv, self.v_conv = (ShortConvolution(H * K, conv_size, rngs=rngs) for _ in range(3))
        bias = jnp.concatenate([jnp.zeros((2 * H,)), jnp.full((H,), ALPHA_BIAS)])  # theta, eta, alpha logits
        self.gate_proj = Linear(d_model, 3 * H, use_bias=True, dtype=dtype, rngs=rngs,
                                bias_init=lambda *_: bias, kernel_metadata=axes("embed", None))
        xavier = nnx.initializers.xavier_uniform(batch_axis=(0,))
        if memory_depth == 1:
            self.W0 = nnx.Param(xavier(rngs.params(), (H, K, K), jnp.float32), **axes("heads", None, None))
        else:
            F = self.hidden_ratio * K
            self.W1 = nnx.Param(xavier(rngs.params(), (H, K, F), jnp.float32), **axes("heads", None, None))
            self.W2 = nnx.Param(xavier(rngs.params(), (H, F, K), jnp.float32), **axes("heads", None, None))
        self.g_proj = linear(d_model, H * K) if use_output_gate else None
        self.o_norm = GatedRMSNorm(K, eps=norm_eps) if use_output_gate else RMSNorm(K, eps=norm_eps)
        self.o_proj = linear(H * K, d_model, ROWS)

    def memory_start(self):
        """The learned start of the memory: W0 (H, K, K), or the deep memory's pair (W1, W2)."""
        return self.W0[...] if self.memory_depth == 1 else (self.W1[...], self.W2[...])

    def init_state(self, batch_size: int, max_len: int = 0) -> TitansState | TitansMLPState:
        """The learned start at position 0; max_len is accepted and ignored (the state does not grow)."""
        windows = init_windows((self.q_conv, self.k_conv, self.v_conv), batch_size, self.dtype)
        pos = jnp.zeros((batch_size,), jnp.int32)
        if self.memory_depth == 1:
            W = jnp.broadcast_to(self.W0[...], (batch_size, self.num_heads, self.head_dim, self.head_dim))
            return TitansState(W, W, jnp.zeros_like(W), pos, *windows)
        W = tuple(jnp.broadcast_to(w, (batch_size, *w.shape)) for w in self.memory_start())
        return TitansMLPState(*W, *W, *map(jnp.zeros_like, W), pos, *windows)

    def _mix(self, x, state: TitansState | TitansMLPState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        x = x.astype(self.dtype)
        (q, k, v), windows = convolve((self.q_conv, self.k_conv, self.v_conv), (self.q_proj(x), self.k_proj(x),
                                      self.v_proj(x)), (state.conv_q, state.conv_k, state.conv_v),
                                      segment_ids=segment_ids, steps=steps)
        q, k, v = (a.reshape(B, T, H, K) for a in (q, k, v))  # (B, T, H, K)
        q, k = normalize_qk(q, "l2"), normalize_qk(k, "l2")
        z = self.gate_proj(x).astype(jnp.float32).reshape(B, T, 3, H)  # (B, T, 3, H): theta, eta, alpha logits
        theta = self.max_lr * jax.nn.sigmoid(z[:, :, 0]) / self.head_dim  # the loss: a mean over the K channels
        log_eta, log_decay = jax.nn.log_sigmoid(z[:, :, 1]), jax.nn.log_sigmoid(-z[:, :, 2])  # log eta, log(1 - alpha)
        op = lambda S, q, k, v, theta, log_eta, log_decay: titans(
            q, k, v, theta, log_eta, log_decay, self.memory_start(), mini_batch_size=self.mini_batch_size,
            segment_ids=segment_ids, initial_state=S, output_final_state=True, mode=mode, impl=self.impl)
        deep = self.memory_depth == 2
        S = ((state.W1, state.W2), (state.M1, state.M2), (state.S1, state.S2), state.pos) if deep else \
            (state.W, state.M, state.S, state.pos)
        args = (S, q, k, v, theta, log_eta, log_decay)
        o, S = stepwise(op, *args) if steps else op(*args)  # o: (B, T, H, K)
        o = self.o_norm(o) if self.g_proj is None else self.o_norm(o, self.g_proj(x).reshape(o.shape))
        y = self.o_proj(o.reshape(B, T, H * K))  # (B, T, D)
        cls = TitansMLPState if deep else TitansState
        fields = (*S[0], *S[1], *S[2], S[3]) if deep else S
        return y, (cls.stepped if steps else cls)(*fields, *windows)
