"""HGRN2 token mixer (Qin et al., 2024, "HGRN2: Gated Linear RNNs with State Expansion"), as the
authors' flash-linear-attention layer (`fla/layers/hgrn2.py`, `HGRN2Attention`) computes it.

Per head, with the forget gate lower-bounded by gamma^l, a bound that grows with depth (HGRN's
"lower layers short-term, upper layers long-term"):

    f_t = gamma^l + (1 - gamma^l) sigmoid(x_t W_f)         forget gate, in (gamma^l, 1), per key channel
    i_t = 1 - f_t                                         input gate, tied to the forget gate: the key
    q_t = SiLU(x_t W_q),   v_t = x_t W_i                  output gate (the query) and input (the value)
    S_t = diag(f_t) S_{t-1} + i_t v_t^T                   S_t in R^{K x V}: the outer-product expansion
    o_t = K^-1/2 q_t S_t
    y_t = RMSNorm(o_t over all heads) W_o

This is exactly gated linear attention with k = 1 - f and log-decay g = log f, so it runs through
kernels/gla in every mode and implementation (recurrent, chunk, parallel, Pallas) with no kernel of
its own. g is formed in log space, log(gamma + (1 - gamma) sigmoid(z)) =
logaddexp(log gamma, log(1 - gamma) + logsigmoid(z)), and k = -expm1(g), both without cancellation.

Code names: `num_heads` H, `expand_ratio` K (a head's key / forget width; fla's name), V = d_model / H
the value width per head, `q_proj` W_q, `f_proj` W_f, `i_proj` W_i, `o_proj` W_o, `g_norm` the
RMSNorm over the H*V outputs, `lower_bound` gamma^l (through `bound_logit`).

Departures, all named:
- The lower bound. fla (and HGRN) keep one (num_layers, D) parameter for the whole model, softmax it
  over the layers and take the cumulative sum minus the first term, so gamma^l is non-decreasing in
  depth by construction and gamma^0 = 0. A zoo layer owns only its own parameters, so here layer l > 0
  has its own per-channel gamma^l = sigmoid(bound_logit), initialised to l / num_layers: exactly fla's
  initial value (a zero parameter softmaxes to 1 / L per layer), but the increase with depth is not
  enforced during training. Layer 0 has no bound and no parameter (gamma^0 = 0, as in fla). The bound
  is per key channel of each head (fla: per channel of the forget width, the same thing).
- conv_size > 0 adds fla's optional short convolutions on q, f and i (without activation, as fla); the
  default 0 is fla's use_short_conv=False.
- Initialisation: the zoo's Linear default (fla's model: normal(0, 0.02)).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.gla import gla
from layers.conv import ShortConvolution, convolve, init_windows
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, Mode, NonNegInt, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class HGRN2State:
    S: Float[Array, "B H K V"]  # (B, H, K, V) float32 recurrent state
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_f: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K)
    conv_i: Float[Array, "B W D"] | None  # (B, conv_size - 1, d_model)


class HGRN2(SequenceMixer):
    """HGRN2 (Qin et al. 2024): gated linear RNN with outer-product state expansion: forget gate with a learned lower
    bound that starts at layer_id / num_layers (the model's depth), input gate 1 - forget as the key, SiLU query as the
    output gate (the GLA op); num_heads divides d_model; expand_ratio: key width per head (None = d_model / num_heads);
    conv_size: short convolutions on q, f, i (0 = none); norm_eps: the output norm's; mode ("recurrent" | "chunk" |
    "parallel") picks the training path's exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" |
    "pallas") picks the op's implementation on every path (the GLA op's); dtype: the compute dtype (parameters stay
    float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, expand_ratio: PosInt | None = None,
                 conv_size: NonNegInt = 0, norm_eps: PosFloat = 1e-5, layer_id: int = 0, num_layers: int = 1,
                 mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"HGRN2: num_heads={num_heads} does not divide d_model={d_model}")
        K = d_model // num_heads if expand_ratio is None else expand_ratio
        if K < 1:
            raise ValueError(f"HGRN2: expand_ratio={expand_ratio} must be positive")
        if conv_size < 0:
            raise ValueError(f"HGRN2: conv_size={conv_size} must be >= 0 (0 = no short convolution)")
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"HGRN2: layer_id={layer_id} must be in [0, num_layers={num_layers})")
        check_mode(mode, chunk_size, "HGRN2")
        check_impl(impl, "HGRN2")
        H = num_heads
        self.d_model, self.num_heads, self.key_dim, self.value_dim = d_model, H, K, d_model // H
        self.conv_size, self.mode, self.chunk_size, self.impl, self.dtype = conv_size, mode, chunk_size, impl, dtype
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.q_proj, self.f_proj, self.i_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, d_model)
        self.o_proj = linear(d_model, d_model, ROWS)
        self.g_norm = RMSNorm(d_model, eps=norm_eps)
        # gamma^l = l / L at initialisation (fla's value); layer 0 has none.
        r = layer_id / num_layers
        self.bound_logit = (nnx.Param(jnp.full((H * K,), math.log(r / (1 - r)), jnp.float32), **axes("heads"))
                            if layer_id > 0 else None)
        if conv_size:
            conv = lambda dim: ShortConvolution(dim, conv_size, activation=False, rngs=rngs)
            self.q_conv, self.f_conv, self.i_conv = conv(H * K), conv(H * K), conv(d_model)

    def init_state(self, batch_size: int, max_len: int = 0) -> HGRN2State:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        S = jnp.zeros((batch_size, self.num_heads, self.key_dim, self.value_dim), jnp.float32)
        return HGRN2State(S, *init_windows(self._convs(), batch_size, self.dtype))

    def _convs(self) -> tuple:
        return (self.q_conv, self.f_conv, self.i_conv) if self.conv_size else (None, None, None)

    def forget_gate(self, z: Float[Array, "B T F"]) -> Float[Array, "B T F"]:
        """log f_t from the projection z = x W_f (F = H*K), in float32."""
        g = jax.nn.log_sigmoid(z.astype(jnp.float32))
        if self.bound_logit is None:
            return g
        bound = self.bound_logit[...]  # log gamma = logsigmoid(b), log(1 - gamma) = logsigmoid(-b)
        return jnp.logaddexp(jax.nn.log_sigmoid(bound), jax.nn.log_sigmoid(-bound) + g)

    def _mix(self, x, state: HGRN2State, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H = self.num_heads
        x = x.astype(self.dtype)
        q, f, i = self.q_proj(x), self.f_proj(x), self.i_proj(x)
        (q, f, i), windows = convolve(self._convs(), (q, f, i), (state.conv_q, state.conv_f, state.conv_i),
                                      segment_ids=segment_ids, steps=steps)
        g = self.forget_gate(f).reshape(B, T, H, -1)  # (B, T, H, K) log f_t
        k = (-jnp.expm1(g)).astype(x.dtype)  # 1 - f_t
        q = jax.nn.silu(q).reshape(B, T, H, -1)  # (B, T, H, K)
        v = i.reshape(B, T, H, -1)  # (B, T, H, V)
        op = lambda S, q, k, v, g: gla(q, k, v, g, segment_ids=segment_ids, initial_state=S, output_final_state=True,
                                       mode=mode, chunk_size=self.chunk_size, impl=self.impl)
        o, S = stepwise(op, state.S, q, k, v, g) if steps else op(state.S, q, k, v, g)  # o: (B, T, H, V)
        y = self.o_proj(self.g_norm(o.reshape(B, T, self.d_model)))  # (B, T, D)
        return y, (HGRN2State.stepped if steps else HGRN2State)(S, *windows)
