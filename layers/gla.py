"""Gated linear attention layer (Yang et al., 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training", the GLA Transformer layer).

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V      (optionally each through a short causal conv + silu)
    alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1/tau),  so  g_t = log alpha_t = logsigmoid(x_t W_a1 W_a2 + b_a) / tau
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = K^-1/2 q_t S_t           per head
    r_t = swish(x_t W_r)
    y_t = (r_t ⊙ norm_h(o_t)) W_O

Code names: gk_down / gk_up are W_a1 (d_model x gate_low_rank_dim) and W_a2 (with bias b_a);
gate_logit_normalizer is tau (16 in the paper); g_proj is W_r; expand_k / expand_v set the key and
value widths (d_model / 2 and d_model in the paper). The recurrence runs in kernels.gla (recurrent,
chunk or parallel, all equal); `impl` picks its implementation ("auto", "reference", "xla" or
"pallas", see kernels/gla) on every path: the training call, a multi-token decode and the
single-token decode step. impl="reference" runs the token-by-token scan whatever the mode;
impl="pallas" runs the Pallas kernels, whose chunk is their own block size (mode and chunk_size are
then unused): the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).

Departures from the paper, named (all as in the authors' flash-linear-attention layer):
- norm_h is an RMSNorm per head with a weight shared by the heads (the paper writes LayerNorm),
  fused with the swish gate (layers.norm.GatedRMSNorm); use_output_gate=False keeps the norm and
  drops the gate.
- conv_size > 0 adds a short causal convolution with silu on q, k and v (layers.conv.ShortConvolution;
  not in the paper, from the fla layer); its windows live in the decode state.
- initialisation: Xavier-uniform with gain 2^-2.5 on every linear weight and zero biases, as in the
  authors' code.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.gla import gla
from layers.conv import ShortConvolution, convolve, init_windows
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm, RMSNorm
from layers.options import Impl, Mode, NonNegInt, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class GLAState:
    S: Float[Array, "B H K V"]  # (B, H, K, V) float32 recurrent state
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, key_dim) conv window, None if conv_size=0
    conv_k: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, key_dim)
    conv_v: Float[Array, "B W H*V"] | None  # (B, conv_size - 1, value_dim)


class GatedLinearAttention(SequenceMixer):
    """Gated linear attention (Yang et al. 2024): data-dependent per-key decay from a low-rank gate (gate_low_rank_dim
    wide, logits divided by gate_logit_normalizer tau); expand_k / expand_v: the key and value widths as multiples of
    d_model (the heads must divide both); conv_size: short convolutions on q, k, v (0 = none); use_output_gate: a swish
    output gate on the normed output (eps norm_eps); mode ("recurrent" | "chunk" | "parallel") picks the training path's
    exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path; dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, expand_k: PosFloat = 0.5, expand_v: PosFloat = 1.0,
                 gate_low_rank_dim: PosInt = 16, gate_logit_normalizer: PosFloat = 16.0, conv_size: NonNegInt = 0,
                 use_output_gate: bool = True, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64,
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        key_dim, value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if key_dim < 1 or value_dim < 1 or key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the key width {key_dim} (d_model * expand_k) "
                             f"and the value width {value_dim} (d_model * expand_v)")
        if gate_low_rank_dim < 1 or gate_logit_normalizer <= 0:
            raise ValueError(f"gate_low_rank_dim={gate_low_rank_dim} must be >= 1 and "
                             f"gate_logit_normalizer={gate_logit_normalizer} > 0")
        if conv_size < 0:
            raise ValueError(f"conv_size={conv_size} must be >= 0 (0 = no short convolution)")
        check_mode(mode, chunk_size, "GLA")
        check_impl(impl, "GLA")
        self.d_model, self.num_heads, self.key_dim, self.value_dim = d_model, num_heads, key_dim, value_dim
        self.gate_logit_normalizer, self.use_output_gate = gate_logit_normalizer, use_output_gate
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype
        xavier = nnx.initializers.variance_scaling(2 ** -5, "fan_avg", "uniform")  # gain 2^-2.5
        linear = lambda i, o, names=COLUMNS, bias=False: Linear(
            i, o, use_bias=bias, dtype=dtype, kernel_init=xavier, rngs=rngs, kernel_metadata=axes(*names),
            bias_metadata=axes(names[1]))
        self.q_proj, self.k_proj = linear(d_model, key_dim), linear(d_model, key_dim)
        self.v_proj = linear(d_model, value_dim)
        self.gk_down = linear(d_model, gate_low_rank_dim, ("embed", None))
        self.gk_up = linear(gate_low_rank_dim, key_dim, (None, "heads"), bias=True)
        self.g_proj = linear(d_model, value_dim) if use_output_gate else None
        self.o_proj = linear(value_dim, d_model, ROWS)
        head_v = value_dim // num_heads
        self.norm = GatedRMSNorm(head_v, eps=norm_eps) if use_output_gate else RMSNorm(head_v, eps=norm_eps)
        if conv_size:
            conv = lambda dim: ShortConvolution(dim, conv_size, activation=True, rngs=rngs)
            self.conv_q, self.conv_k, self.conv_v = conv(key_dim), conv(key_dim), conv(value_dim)
        self.conv_size = conv_size

    def init_state(self, batch_size: int, max_len: int = 0) -> GLAState:
        """max_len is ignored: the state has a fixed size."""
        H = self.num_heads
        S = jnp.zeros((batch_size, H, self.key_dim // H, self.value_dim // H), jnp.float32)
        return GLAState(S, *init_windows(self._convs(), batch_size, self.dtype))

    def _convs(self) -> tuple:
        return (self.conv_q, self.conv_k, self.conv_v) if self.conv_size else (None, None, None)

    def _mix(self, x, state: GLAState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H = self.num_heads
        x = x.astype(self.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, key_dim / value_dim)
        (q, k, v), windows = convolve(self._convs(), (q, k, v), (state.conv_q, state.conv_k, state.conv_v),
                                      segment_ids=segment_ids, steps=steps)
        logits = self.gk_up(self.gk_down(x)).astype(jnp.float32)
        g = (jax.nn.log_sigmoid(logits) / self.gate_logit_normalizer).reshape(B, T, H, -1)  # (B, T, H, K)
        q, k, v = q.reshape(B, T, H, -1), k.reshape(B, T, H, -1), v.reshape(B, T, H, -1)
        op = lambda S, q, k, v, g: gla(q, k, v, g, segment_ids=segment_ids, initial_state=S, output_final_state=True,
                                       mode=mode, chunk_size=self.chunk_size, impl=self.impl)
        o, S = stepwise(op, state.S, q, k, v, g) if steps else op(state.S, q, k, v, g)  # o: (B, T, H, V)
        o = self.norm(o, self.g_proj(x).reshape(B, T, H, -1)) if self.use_output_gate else self.norm(o)
        y = self.o_proj(o.reshape(B, T, self.value_dim))
        return y, (GLAState.stepped if steps else GLAState)(S, *windows)
