"""sLSTM token mixer (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", Section 2.2 and
Appendix A), as the official `sLSTMLayer` (NX-AI/xlstm, `xlstm/blocks/slstm/layer.py`) computes it:

    u_t = SiLU(CausalConv1d(x_t))                        width 4, its own bias; conv_size 0: u_t = x_t
    ĩ_t = W_i u_t,  f̃_t = W_f u_t,  z̃_t = W_z x_t,  õ_t = W_o x_t     headwise (block-diagonal) projections
    h_t = sLSTM cell of (ĩ, f̃, z̃, õ) + R h_{t-1} + b     kernels/slstm: exponential input gate, stabiliser m
    y_t = GroupNorm(h_t), one group per head             the official MultiHeadLayerNorm (weight, no bias)

The cell (kernels/slstm/reference.py): m_t = max(log f_t + m_{t-1}, ĩ_t), i' = exp(ĩ - m_t),
f' = exp(log f_t + m_{t-1} - m_t), c_t = f' c_{t-1} + i' tanh(z̃), n_t = f' n_{t-1} + i',
h_t = σ(õ) c_t / n_t, with log f_t = logsigmoid(f̃) (forget_gate "sigmoid", the official default) or f̃
("exp"). In the official sLSTM block the mixer is followed by a gated MLP (projection factor 4/3): the
zoo's block gives it through `ffn` (configs/slstm.yaml), and the layer itself has no output projection,
as the official one has none.

Recurrent only: every gate reads h_{t-1} through R, so there is no chunkwise or parallel form; training
runs the scan over time (T sequential steps, each a (B, H, K) x (H, K, 4K) product), and the layer has
no `mode`. Decode state per layer: c, n, m, h (B, H, K) float32 and the convolution's window
(B, conv_size - 1, d_model).

Code names: `num_heads` H, K = d_model / H the head width, `conv` the causal convolution, `w_in` the
four headwise projections W_i, W_f, W_z, W_o stacked (4, H, K, K) (in, out per head), `recurrent` R
(4, H, K, K), `bias` b (4, H, K), `norm_weight` the group norm's scale.

Initialisation as the official: W small-init normal(0, sqrt(2 / (5 d_model))); R zero; b zero but the
forget gate's, the "powerlaw_blockdependent" ramp b_f[k] = 5 - 12 (k / (K - 1))^(0.3 + 1.3 l / (L - 1))
over each head's channels (l = layer_id, L = num_layers; the exponent 0.3 when L = 1).

Departures, all named:
- The stabiliser of an empty state (a zero state, and each packed document's first token) is the
  official CUDA kernel's per-element m_t = ĩ_t (its vanilla PyTorch cell tests the whole batch at
  once); the official clamps of i', f' and o at 1 are dropped (no-ops: their exponents are <= 0).
- The cell runs in float32 whatever `dtype` (the official computes it in its config's dtype, bfloat16
  by default); the projections and the convolution run in `dtype`.
- The group norm's scale is stored as w, initialised at 1 (the official stores w - 1 at 0 and adds 1,
  the same function; it differs only under weight decay).
- The convolution is the zoo's ShortConvolution (layers/conv.py): its bias starts at zero (PyTorch's
  Conv1d draws it uniformly); its weights are drawn as PyTorch's default, as the official.
- No dropout. Packed documents (segment_ids) reset the cell and the convolution window at each
  document start, which the official code has no notion of.
"""

from typing import Annotated

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_no_pallas
from kernels.slstm import FORGET_GATES, slstm
from layers.conv import ShortConvolution, convolve, init_windows
from layers.mixer import SequenceMixer
from layers.norm import head_group_norm
from layers.options import Impl, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import axes
from layers.state import state, stepwise


@state
class SLSTMState:
    c: Float[Array, "B H K"]  # (B, H, K) float32 cell state (stabilised: the true c times exp(-m))
    n: Float[Array, "B H K"]  # (B, H, K) float32 normaliser state (stabilised alike); 0 = empty
    m: Float[Array, "B H K"]  # (B, H, K) float32 stabiliser, the log of the scale of c and n
    h: Float[Array, "B H K"]  # (B, H, K) float32 the last output, fed back through R
    conv: Float[Array, "B W D"] | None  # (B, conv_size - 1, d_model) the convolution's window; None without


def forget_bias(K: int, layer_id: int, num_layers: int) -> Float[Array, " K"]:
    """The official "powerlaw_blockdependent" forget-gate bias of one head: from +5 down to -7."""
    ratio = layer_id / (num_layers - 1) if num_layers > 1 else 0.0
    return 5.0 - 12.0 * jnp.linspace(0.0, 1.0, K) ** (0.3 + 1.3 * ratio)


class SLSTM(SequenceMixer):
    """sLSTM (Beck et al. 2024, xLSTM): scalar-memory LSTM with exponential input gate, stabiliser and block-diagonal
    recurrent connections per head, recurrent only (no parallel form); num_heads divides d_model; conv_size: the causal
    convolution + SiLU feeding the input and forget gates (0 = none, the official default 4); forget_gate ("sigmoid" |
    "exp"): log f = logsigmoid(f̃) or f̃; norm_eps: the per-head group norm's; impl ("auto" | "reference" | "xla") the
    op's implementation (one scan; "pallas" refused); dtype: the compute dtype of the projections (the cell and the
    parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, conv_size: NonNegInt = 4,
                 forget_gate: Annotated[str, OneOf(*FORGET_GATES)] = "sigmoid", norm_eps: PosFloat = 1e-5,
                 layer_id: int = 0, num_layers: int = 1, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"SLSTM: num_heads={num_heads} does not divide d_model={d_model}")
        if conv_size < 0:
            raise ValueError(f"SLSTM: conv_size={conv_size} must be >= 0 (0 = no convolution)")
        if forget_gate not in FORGET_GATES:
            raise ValueError(f"SLSTM: forget_gate={forget_gate!r}; expected one of {FORGET_GATES}")
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"SLSTM: layer_id={layer_id} must be in [0, num_layers={num_layers})")
        check_no_pallas(impl, "SLSTM")  # an unknown impl too
        H, K = num_heads, d_model // num_heads
        self.d_model, self.num_heads, self.head_dim, self.conv_size = d_model, H, K, conv_size
        self.forget_gate, self.norm_eps, self.impl, self.dtype = forget_gate, norm_eps, impl, dtype
        self.w_in = nnx.Param(nnx.initializers.normal((2 / (5 * d_model)) ** 0.5)(rngs.params(), (4, H, K, K)),
                              **axes(None, "heads", None, None))
        self.recurrent = nnx.Param(jnp.zeros((4, H, K, K), jnp.float32), **axes(None, "heads", None, None))
        bias = jnp.zeros((4, H, K), jnp.float32).at[1].set(forget_bias(K, layer_id, num_layers))
        self.bias = nnx.Param(bias, **axes(None, "heads", None))
        self.norm_weight = nnx.Param(jnp.ones((d_model,), jnp.float32), **axes("heads"))
        self.conv = ShortConvolution(d_model, conv_size, use_bias=True, rngs=rngs) if conv_size else None

    def init_state(self, batch_size: int, max_len: int = 0) -> SLSTMState:
        """A zero (empty) state; max_len is accepted and ignored (the state does not grow with context)."""
        zeros = jnp.zeros((batch_size, self.num_heads, self.head_dim), jnp.float32)
        return SLSTMState(zeros, zeros, zeros, zeros, *init_windows((self.conv,), batch_size, self.dtype))

    def _mix(self, x, state: SLSTMState, segment_ids, mode, steps: bool):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        x = x.astype(self.dtype)
        (u,), (window,) = convolve((self.conv,), (x,), (state.conv,), segment_ids=segment_ids, steps=steps)
        w = self.w_in[...].astype(self.dtype)
        heads = lambda a: a.reshape(B, T, H, K)  # (B, T, H, K)
        gates = jnp.concatenate([jnp.einsum("bthk,ghkj->btghj", heads(u), w[:2]),  # ĩ, f̃ from the conv branch
                                 jnp.einsum("bthk,ghkj->btghj", heads(x), w[2:])], axis=2)  # z̃, õ: (B, T, 4, H, K)
        op = lambda carry, gates: slstm(gates, self.recurrent[...], self.bias[...], segment_ids=segment_ids,
                                        initial_state=carry, output_final_state=True, forget_gate=self.forget_gate,
                                        impl=self.impl)
        carry = (state.c, state.n, state.m, state.h)
        h, carry = stepwise(op, carry, gates) if steps else op(carry, gates)  # h: (B, T, H, K)
        y = head_group_norm(h, self.norm_weight[...], 0.0, self.norm_eps)  # (B, T, D) float32
        return y.astype(self.dtype), (SLSTMState.stepped if steps else SLSTMState)(*carry, window)
