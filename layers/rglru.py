"""The recurrent block of Hawk and Griffin (De et al., 2024, "Griffin: Mixing Gated Linear Recurrences with
Local Attention for Efficient Language Models", Section 2.4 and Figure 2), following recurrentgemma's
`RecurrentBlock`, `Conv1D` and `RGLRU` (google-deepmind/recurrentgemma, recurrentgemma/jax/):

    g = GeLU(x W_y + b_y)                                   gate branch, width Dm = lru_width
    u = Conv1D(x W_x + b_x)                                 causal, per channel, conv_size taps and a bias
    r_t = σ(u_t W_a + b_a),  i_t = σ(u_t W_i + b_i)         block-diagonal: num_heads blocks of Dm / H
    log a_t = -c r_t softplus(-Λ),  h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ u_t)    (kernels/rglru)
    out = (h ⊙ g) W_out + b_out

Hawk is a stack of these blocks (each followed by an MLP); Griffin interleaves two of them with one block
of local multi-query attention (configs/hawk.yaml, configs/griffin.yaml).

Code name -> paper / recurrentgemma symbol: `linear_y` W_y (the gate branch), `linear_x` W_x (the recurrent
branch), `conv` Conv1D (`conv_1d`), `gate_a` W_a, b_a (the recurrence gate r_t, `a_gate`), `gate_x` W_x,
b_x of the RG-LRU (the input gate i_t, `input_gate`), `a_param` Λ with a = σ(Λ), `c` the constant c = 8,
`linear_out` W_out; the decode state's `h` is the RG-LRU state (B, Dm) float32 (`rg_lru_state`), `conv`
the last conv_size - 1 conv inputs (`conv1d_state`) and `started` whether the row has seen a token.

Initialisation as recurrentgemma: W_y and W_x normal with variance 1 / d_model, the gates with variance
1 / lru_width (flax's fan_in of an (H, Dm / H, Dm / H) weight counts the block axis too, as in
recurrentgemma), W_out with variance (2 / num_layers) / lru_width, the conv taps with variance
0.01 / conv_size, every bias 0, and Λ so that a = σ(Λ) has a² uniform in [0.9², 0.999²].

Document starts: a row's first token (segment_ids' change of id, or token 0 of a fresh state) drops the
state and takes the multiplier 1 in place of sqrt(1 - a_t²), as recurrentgemma does at `segment_pos == 0`;
the conv reads no input of another document. `started` carries across decode calls whether the next token
continues a document, so prefill + decode, packed rows and rows alone all agree.

Departures, all named:
- Λ is the paper's (a = σ(Λ)); recurrentgemma stores its negative (`a_param`, a = exp(-softplus(a_param))).
  Same function and the same initial a.
- The conv is layers/conv.py's ShortConvolution (taps w_j on x_{t-W+1+j}, the same order as Conv1D's and
  the same document masking), its weights initialised as recurrentgemma's; `conv_size=0` drops it.
- Only the real RG-LRU (recurrentgemma's default `only_real=True`), min_rad fixed at 0.9.
- The RG-LRU runs in float32 whatever the compute dtype (recurrentgemma runs it in the compute dtype with a
  float32 accumulator); the gates' linears run in the compute dtype.
- `mode` picks the op's form: "recurrent" (the scan) or "parallel" (the associative scan); recurrentgemma
  picks a linear scan or its Pallas kernel on TPU. No Pallas kernel here (impl="pallas" is refused).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float

from kernels import check_no_pallas
from kernels.rglru import MODES, rglru
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.options import Impl, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise

MIN_RAD, MAX_RAD = 0.9, 0.999  # the range of a = σ(Λ) at initialisation (recurrentgemma's)


@state
class RGLRUState:
    h: Float[Array, "B Dm"]  # (B, lru_width) float32 RG-LRU state
    conv: Float[Array, "B W Dm"] | None  # (B, conv_size - 1, lru_width) last conv inputs; None when conv_size = 0
    started: Bool[Array, " B"]  # (B,) whether the row has seen a token (if not, its next token starts a document)


def fan_in_normal(scale: float):
    """Normal with variance scale / fan_in, fan_in the second-to-last axis (recurrentgemma's variance_scaling)."""
    return nnx.initializers.variance_scaling(scale, "fan_in", "normal")


def ring_init(key, width: int) -> Float[Array, " Dm"]:
    """Λ with a = σ(Λ), a² uniform in [MIN_RAD², MAX_RAD²] (uniform over the area of that ring)."""
    a = jnp.sqrt(jax.random.uniform(key, (width,), jnp.float32, MIN_RAD ** 2, MAX_RAD ** 2))
    return jnp.log(a) - jnp.log1p(-a)  # logit(a)


class BlockDiagonalLinear(nnx.Module):
    """y = x W + b with W block-diagonal: `num_blocks` independent (width / num_blocks)-square blocks."""

    def __init__(self, width: int, num_blocks: int, *, dtype, rngs: nnx.Rngs):
        H, K = num_blocks, width // num_blocks
        self.w = nnx.Param(fan_in_normal(1.0)(rngs.params(), (H, K, K), jnp.float32), **axes("heads", None, None))
        self.b = nnx.Param(jnp.zeros((H, K), jnp.float32), **axes("heads", None))
        self.dtype = dtype

    def __call__(self, x: Float[Array, "B T Dm"]) -> Float[Array, "B T Dm"]:
        H, K, _ = self.w.shape
        xs = x.reshape(-1, H, K).astype(self.dtype)  # (B*T, H, K)
        y = jnp.einsum("nhk,hkj->nhj", xs, self.w[...].astype(self.dtype)) + self.b[...].astype(self.dtype)
        return y.reshape(x.shape)  # (B, T, Dm)


class RGLRU(SequenceMixer):
    """Hawk / Griffin recurrent block (De et al. 2024): GeLU gate branch times the RG-LRU branch (linear, causal conv of
    conv_size taps with bias, 0 = none, then the real-gated linear recurrence a_t = σ(Λ)^(c r_t) with block-diagonal
    gates of num_heads blocks); lru_width: the recurrence's width (None = d_model), num_heads divides it; c: the decay
    exponent's constant; mode ("recurrent" | "parallel") picks the exact scan of the training path and prefill; impl
    ("auto" | "reference" | "xla"; no Pallas kernel) the op's implementation; dtype: the compute dtype (parameters and
    the recurrence stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, lru_width: PosInt | None = None, num_heads: PosInt = 4,
                 conv_size: NonNegInt = 4, c: PosFloat = 8.0, num_layers: int = 1,
                 mode: Annotated[str, OneOf(*MODES)] = "recurrent",
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        Dm = d_model if lru_width is None else lru_width
        if Dm < 1:
            raise ValueError(f"RGLRU: lru_width={lru_width} must be a positive int or None (= d_model)")
        if num_heads < 1 or Dm % num_heads:
            raise ValueError(f"RGLRU: num_heads={num_heads} does not divide lru_width={Dm}")
        if conv_size < 0:
            raise ValueError(f"RGLRU: conv_size={conv_size} must be >= 0 (0 = no convolution)")
        if not c > 0:
            raise ValueError(f"RGLRU: c={c} must be > 0")
        if mode not in MODES:
            raise ValueError(f"RGLRU: mode={mode!r}; expected one of {MODES}")
        check_no_pallas(impl, "RGLRU")
        self.d_model, self.lru_width, self.num_heads, self.conv_size, self.c = d_model, Dm, num_heads, conv_size, c
        self.mode, self.impl, self.dtype = mode, impl, dtype

        def linear(i, o, names, scale):
            return Linear(i, o, dtype=dtype, param_dtype=jnp.float32, rngs=rngs, kernel_init=fan_in_normal(scale),
                          kernel_metadata=axes(*names), bias_metadata=axes(names[1]))

        self.linear_y, self.linear_x = linear(d_model, Dm, COLUMNS, 1.0), linear(d_model, Dm, COLUMNS, 1.0)
        self.linear_out = linear(Dm, d_model, ROWS, 2.0 / max(num_layers, 1))
        self.conv = ShortConvolution(Dm, conv_size, activation=False, use_bias=True, rngs=rngs) if conv_size else None
        if conv_size:
            self.conv.weight[...] = fan_in_normal(0.01)(rngs.params(), (conv_size, Dm), jnp.float32)
        self.gate_a = BlockDiagonalLinear(Dm, num_heads, dtype=dtype, rngs=rngs)
        self.gate_x = BlockDiagonalLinear(Dm, num_heads, dtype=dtype, rngs=rngs)
        self.a_param = nnx.Param(ring_init(rngs.params(), Dm), **axes("heads"))

    step_mode = "recurrent"  # decode: the scan for one token and steps=True, the layer's mode for T > 1

    @property
    def prefill_mode(self) -> str:
        return self.mode

    def init_state(self, batch_size: int, max_len: int = 0) -> RGLRUState:
        """A fresh state; max_len is accepted and ignored (the state does not grow with context)."""
        conv = None if self.conv is None else self.conv.init_state(batch_size, self.dtype)
        return RGLRUState(jnp.zeros((batch_size, self.lru_width), jnp.float32), conv,
                          jnp.zeros((batch_size,), bool))

    def decay(self) -> Float[Array, " Dm"]:
        """a = σ(Λ) per channel (a_t = a^(c r_t)): what the initialisation puts in [0.9, 0.999]."""
        return jax.nn.sigmoid(self.a_param[...])

    def _mix(self, x, state: RGLRUState, segment_ids, mode: str, steps: bool):
        x = x.astype(self.dtype)
        g = jax.nn.gelu(self.linear_y(x))  # (B, T, Dm); tanh approximation, as recurrentgemma's jax.nn.gelu
        u, conv = self.linear_x(x), None
        if self.conv is not None:
            u, conv = self.conv.decode(u, state.conv, segment_ids=segment_ids, steps=steps)
        r, i = jax.nn.sigmoid(self.gate_a(u)), jax.nn.sigmoid(self.gate_x(u))  # (B, T, Dm) r_t, i_t

        def op(carry, u, r, i):
            h, started = carry
            y, h = rglru(u, r, i, self.a_param[...], c=self.c, segment_ids=segment_ids, initial_state=h,
                         first_starts=~started, output_final_state=True, mode=mode, impl=self.impl)
            return y, (h, jnp.ones_like(started))

        carry = (state.h, state.started)
        y, (h, started) = stepwise(op, carry, u, r, i) if steps else op(carry, u, r, i)  # y: (B, T, Dm)
        out = self.linear_out(y * g)  # (B, T, D)
        return out, (RGLRUState.stepped if steps else RGLRUState)(h, conv, started)
