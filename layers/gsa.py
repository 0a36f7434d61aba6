"""Gated slot attention token mixer (Zhang et al., 2024, "Gated Slot Attention for Efficient Linear-Time
Sequence Modeling", arXiv 2409.07146), as flash-linear-attention's `GatedSlotAttention` layer computes it.
Per head, M memory slots written with a forget gate and read by a softmax over the slots (a two-pass GLA,
ABC's bounded memory with a data-dependent decay):

    q_t = phi(conv(x W_q)_t),  k_t = phi(conv(x W_k)_t),  v_t = SiLU(conv(x W_v)_t)   (conv only if conv_size)
    g_t = logsigmoid(x_t W_f) / tau,  alpha_t = e^{g_t} in (0, 1)^M,  s_t = 1 - alpha_t
    K~_t = diag(alpha_t) K~_{t-1} + s_t k_t^T,    V~_t = diag(alpha_t) V~_{t-1} + s_t v_t^T
    o_t = V~_t^T softmax(scale * K~_t q_t)                                              (kernels/gsa)
    y_t = RMSNorm(SiLU(o_t) over all heads) W_o

Code names: `num_heads` H, `num_slots` M, `expand_k` / `expand_v` the key and value widths H*K, H*V as
multiples of d_model, `gate_logit_normalizer` tau, `feature_map` phi ("swish" x sigmoid(x), "relu", or
"t2r": relu of a learned K x K map shared by q and k, `t2r`), `f_proj` W_f, `g_norm` the RMSNorm,
`o_proj` W_o. s_t = -expm1(g_t), without cancellation. Decode state: K~ (B, H, M, K) and V~ (B, H, M, V)
float32, plus the three convolutions' windows when conv_size > 0.

Departures from fla, named:
- No num_kv_heads (fla's grouped k, v, f shared by several query heads; its default is none).
- g_norm is RMSNorm over the value width H*V (fla builds it over hidden_size and applies it to value_dim
  channels, the same when expand_v = 1, the only width it runs with); fla's use_output_gate and use_norm
  flags do nothing in its forward and are not options here.
- conv_size > 0 is fla's use_short_conv (SiLU convolutions on q, k, v, no bias); 0, the default, is
  fla's use_short_conv=False.
- num_slots defaults to 64 (fla's model config; its layer's None = K); scale 1.0 as fla's layer.
- Initialisation: the zoo's Linear default (fla's model: normal(0, 0.02)).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.gsa import gsa
from layers.conv import ShortConvolution, convolve, init_windows
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, Mode, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise

FEATURE_MAPS = ("swish", "relu", "t2r")


@state
class GSAState:
    Ks: Float[Array, "B H M K"]  # (B, H, M, K) float32 slot keys K~
    Vs: Float[Array, "B H M V"]  # (B, H, M, V) float32 slot values V~
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W H*V"] | None  # (B, conv_size - 1, H*V)


class GatedSlotAttention(SequenceMixer):
    """Gated slot attention (Zhang et al. 2024): per head num_slots memory slots written with a forget gate alpha =
    sigmoid(.)^(1/gate_logit_normalizer) and strength 1 - alpha, read by a softmax over the slots (two GLA passes);
    expand_k / expand_v: key and value widths as multiples of d_model (num_heads divides both); feature_map ("swish" |
    "relu" | "t2r") on q and k; scale multiplies q (None = K^-1/2); conv_size: SiLU short convolutions on q, k, v
    (0 = none); norm_eps: the output RMSNorm's; mode ("recurrent" | "chunk" | "parallel") picks the training path's
    exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path ("pallas": the GLA kernels for the second pass); dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_slots: PosInt = 64, expand_k: PosFloat = 1.0,
                 expand_v: PosFloat = 1.0, feature_map: Annotated[str, OneOf(*FEATURE_MAPS)] = "swish",
                 gate_logit_normalizer: PosFloat = 8.0, scale: PosFloat | None = 1.0, conv_size: NonNegInt = 0,
                 norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        key_dim, value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if num_heads < 1 or key_dim < 1 or value_dim < 1 or key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the key width {key_dim} (d_model * expand_k) "
                             f"and the value width {value_dim} (d_model * expand_v)")
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map={feature_map!r}; expected one of {FEATURE_MAPS}")
        if gate_logit_normalizer <= 0:
            raise ValueError(f"gate_logit_normalizer={gate_logit_normalizer} must be > 0")
        if conv_size < 0:
            raise ValueError(f"conv_size={conv_size} must be >= 0 (0 = no short convolution)")
        check_mode(mode, chunk_size, "GatedSlotAttention")
        check_impl(impl, "GatedSlotAttention")
        H, M = num_heads, num_slots
        self.d_model, self.num_heads, self.num_slots, self.key_dim, self.value_dim = d_model, H, M, key_dim, value_dim
        self.feature_map, self.gate_logit_normalizer, self.scale = feature_map, gate_logit_normalizer, scale
        self.conv_size, self.mode, self.chunk_size, self.impl, self.dtype = conv_size, mode, chunk_size, impl, dtype
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.q_proj, self.k_proj = linear(d_model, key_dim), linear(d_model, key_dim)
        self.v_proj, self.f_proj = linear(d_model, value_dim), linear(d_model, H * M)
        K = key_dim // H
        self.t2r = linear(K, K, (None, None)) if feature_map == "t2r" else None
        self.g_norm = RMSNorm(value_dim, eps=norm_eps)
        self.o_proj = linear(value_dim, d_model, ROWS)
        if conv_size:
            conv = lambda dim: ShortConvolution(dim, conv_size, activation=True, rngs=rngs)
            self.q_conv, self.k_conv, self.v_conv = conv(key_dim), conv(key_dim), conv(value_dim)

    def init_state(self, batch_size: int, max_len: int = 0) -> GSAState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        H, M = self.num_heads, self.num_slots
        Ks = jnp.zeros((batch_size, H, M, self.key_dim // H), jnp.float32)
        Vs = jnp.zeros((batch_size, H, M, self.value_dim // H), jnp.float32)
        return GSAState(Ks, Vs, *init_windows(self._convs(), batch_size, self.dtype))

    def _convs(self) -> tuple:
        return (self.q_conv, self.k_conv, self.v_conv) if self.conv_size else (None, None, None)

    def phi(self, x: Float[Array, "B T H K"]) -> Float[Array, "B T H K"]:
        """The feature map of q and k."""
        if self.feature_map == "swish":
            return jax.nn.silu(x)
        return jax.nn.relu(x if self.t2r is None else self.t2r(x))

    def _mix(self, x, state: GSAState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H = self.num_heads
        x = x.astype(self.dtype)
        (q, k, v), windows = convolve(self._convs(), (self.q_proj(x), self.k_proj(x), self.v_proj(x)),
                                      (state.conv_q, state.conv_k, state.conv_v), segment_ids=segment_ids, steps=steps)
        q, k = (self.phi(a.reshape(B, T, H, -1)) for a in (q, k))  # (B, T, H, K)
        v = jax.nn.silu(v).reshape(B, T, H, -1)  # (B, T, H, V)
        g = jax.nn.log_sigmoid(self.f_proj(x).astype(jnp.float32)).reshape(B, T, H, -1) / self.gate_logit_normalizer
        s = -jnp.expm1(g)  # (B, T, H, M): 1 - alpha_t
        op = lambda S, q, k, v, s, g: gsa(q, k, v, s, g, scale=self.scale, segment_ids=segment_ids, initial_state=S,
                                          output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                          impl=self.impl)
        args = ((state.Ks, state.Vs), q, k, v, s, g)
        o, (Ks, Vs) = stepwise(op, *args) if steps else op(*args)  # o: (B, T, H, V)
        y = self.o_proj(self.g_norm(jax.nn.silu(o).reshape(B, T, self.value_dim)))  # (B, T, D)
        return y, (GSAState.stepped if steps else GSAState)(Ks, Vs, *windows)
