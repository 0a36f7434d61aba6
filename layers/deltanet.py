"""The delta-rule token mixers: DeltaNet, Gated DeltaNet, Kimi Delta Attention, Gated DeltaProduct.

DeltaNet: Schlag et al., 2021 ("Linear Transformers Are Secretly Fast Weight Programmers"), with the
layer of Yang et al., 2024 ("Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", sec. 3.3 and fla's `DeltaNet`). Gated DeltaNet: Yang, Kautz & Hatamizadeh, 2024 ("Gated
Delta Networks: Improving Mamba2 with Delta Rule", sec. 3 and fla's `GatedDeltaNet`). Per head:

    q_t = norm(SiLU(conv(W_q x)_t)),  k_t = norm(SiLU(conv(W_k x)_t)),  v_t = SiLU(conv(W_v x)_t)
    beta_t = sigmoid(w_beta . x_t)
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(K)
    y_t = W_o [RMSNorm(o_t)]                 or   W_o [RMSNorm(o_t) * SiLU(W_g x_t)]  (output gate)

DeltaNet: alpha_t = 1, norm = L2 ("l2", the paper's choice) or division by the sum ("sum").
Gated DeltaNet (Mamba-2's decay): alpha_t = exp(-exp(A_log) * softplus(w_a . x_t + dt_bias)),
norm = L2, output gate on; A = exp(A_log) ~ U(0, 16] and dt = softplus(dt_bias) log-uniform in
[1e-3, 1e-1] (floored at 1e-4) at initialisation, as in the official code.

Code names: `num_heads` H, `head_dim` K (query/key width per head), `expand_v` V / K, `num_v_heads` HV
(Gated DeltaNet: value heads, default H; each query/key head serves HV / H consecutive value heads),
`b_proj` w_beta, `a_proj` w_a, `g_proj` W_g, `o_norm` the per-head output RMSNorm (weights shared
across heads, as in fla), `impl` the op's implementation ("auto", "reference", "xla" or "pallas", see
kernels/delta_rule) on every path: the training call, a multi-token decode and the single-token
step; impl="pallas" runs the Pallas kernels, whose chunk is their own block size (mode and
chunk_size are then unused): the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).
Decode state: the HV x K x V delta-rule state plus the last conv_size - 1 inputs of each short
convolution (fla's `conv_state`).

Grouped value heads (Gated DeltaNet's `num_v_heads`, Qwen3-Next's linear_num_value_heads > linear_num_key_heads,
fla's GVA): q and k have H heads, v, beta, the decay, the output gate and the state HV; after the L2 norm each
query/key head is repeated for HV / H consecutive value heads (head j reads q, k head j // (HV / H)), as
transformers' Qwen3-Next does.

Kimi Delta Attention (KDA; Kimi Team, 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", and fla's `KimiDeltaAttention`): Gated DeltaNet with a decay per key channel and a
low-rank decay and output gate:

    alpha_t = exp(-exp(A_log) * softplus(W_f2 W_f1 x_t + dt_bias))       in (0, 1)^K per head
    S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T          (decay, then update)
    y_t = W_o [RMSNorm(o_t) * sigmoid(W_g2 W_g1 x_t + b_g)]

W_f1 (d_model x V) and W_f2 (V x H K) are `f_down`, `f_up`; W_g1, W_g2 (with bias b_g, fla's; none with
gate_bias=False, transformers' Kimi Linear) `g_down`, `g_up`; A = exp(A_log) ~ U(1, 16] per head,
dt_bias per key channel (H K), as fla. impl="pallas" runs the delta-rule Pallas kernels with the
per-channel gate, as for the other kinds (kernels/delta_rule).

Gated DeltaProduct (Siems et al., 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via
Householder Products", and fla's `GatedDeltaProduct`): n = num_householder delta-rule steps per
token, each with its own key, value and beta from the token (W_k, W_v, w_beta n times as wide), the
gate once per token:

    S_{t,0} = alpha_t S_{t-1},   S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T
    S_t = S_{t,n},   o_t = S_t^T q_t / sqrt(K)

so the state transition is a product of n generalised Householder matrices. It runs on the
delta-rule op itself: the T tokens become T n sub-steps in a row (the gate on each token's first
sub-step, log-decay 0 on the others; the query on its last, whose output is the token's), exact in
every mode and implementation. `chunk_size` then counts sub-steps. allow_neg_eigval (on by default,
as fla and the paper's best models) doubles beta to (0, 2), so I - beta k k^T has eigenvalues in
(-1, 1]; use_forget_gate=False drops the gate (alpha_t = 1).

Departures, all named: the key width is set by `head_dim` (default d_model / num_heads) instead of
fla DeltaNet's `expand_k` (the same width at the default expand_k = 1); `conv_size=0` replaces fla's
`use_short_conv=False` (SiLU without convolution, as fla does then); no `allow_neg_eigval` on
DeltaNet and Gated DeltaNet, grouped value heads (`num_v_heads`) on Gated DeltaNet only and no qk activations
other than SiLU. KDA: head_dim defaults to d_model / num_heads (fla: 128) and has no `safe_gate` / `lower_bound`
(fla's clamp of the gate for its M = 16 tensor-core path).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.delta_rule.product import delta_product
from layers.conv import ShortConvolution, convolve, init_windows
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm, RMSNorm
from layers.options import Impl, Mode, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class DeltaNetState:
    recurrent: Float[Array, "B HV K V"]  # (B, HV, K, V) float32 delta-rule state, one per value head
    conv_q: Float[Array, "B W HK"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W HK"] | None  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W HV*V"] | None  # (B, conv_size - 1, HV*V)


def normalize_qk(x: Float[Array, "*B K"], kind: str) -> Float[Array, "*B K"]:
    x32 = x.astype(jnp.float32)
    if kind == "l2":
        y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)  # fla's l2norm eps
    else:  # "sum"
        y = x32 / jnp.sum(x32, axis=-1, keepdims=True)
    return y.astype(x.dtype)


def gate_proj(d_model, width, dtype, rngs, bias: bool = False):
    """A projection to a few gate logits per token (beta, the decay's input), kept whole on a mesh."""
    return Linear(d_model, width, use_bias=bias, dtype=dtype, rngs=rngs, kernel_metadata=axes("embed", None))


def decay_params(rngs, num_A: int, num_dt: int, A_low: float):
    """(A_log, dt_bias) of Mamba-2's decay -exp(A_log) softplus(. + dt_bias), initialised as the official
    code: A = exp(A_log) ~ U(A_low, 16] (never 0), dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1],
    floored at 1e-4."""
    A = A_low + (16.0 - A_low) * (1.0 - jax.random.uniform(rngs.params(), (num_A,)))
    log_dt = jax.random.uniform(rngs.params(), (num_dt,), minval=jnp.log(1e-3), maxval=jnp.log(1e-1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return nnx.Param(jnp.log(A)), nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # softplus^-1(dt)


class DeltaRuleMixer(SequenceMixer):
    """The body the layers share; subclasses add their gate parameters and `_gates(x) -> (beta, g)`:
    beta (B, T, n*HV) float32 for n = num_householder keys per token, g (B, T, HV), (B, T, HV, K) or None."""

    context_parallel = True

    State = DeltaNetState

    def __init__(self, d_model, *, num_heads, head_dim, expand_v, conv_size, use_output_gate, qk_norm,
                 norm_eps, mode, chunk_size, impl, dtype, rngs, num_householder=1, num_v_heads=None):
        name = type(self).__name__
        if num_heads < 1 or d_model < 1:
            raise ValueError(f"{name}: num_heads={num_heads} and d_model={d_model} must be positive")
        HV = num_heads if num_v_heads is None else num_v_heads
        if HV < 1 or HV % num_heads:
            raise ValueError(f"{name}: num_v_heads={num_v_heads} must be a positive multiple of num_heads={num_heads}")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"{name}: num_heads={num_heads} does not divide d_model={d_model}")
            head_dim = d_model // num_heads
        if head_dim < 1:
            raise ValueError(f"{name}: head_dim={head_dim} must be positive")
        value_dim = head_dim * expand_v
        if expand_v <= 0 or value_dim != int(value_dim):
            raise ValueError(f"{name}: head_dim * expand_v = {head_dim} * {expand_v} must be a positive integer")
        if conv_size < 0:
            raise ValueError(f"{name}: conv_size={conv_size} must be >= 0 (0 = no short convolution)")
        if qk_norm not in ("l2", "sum"):
            raise ValueError(f"{name}: qk_norm={qk_norm!r}; expected 'l2' or 'sum'")
        check_mode(mode, chunk_size, name)
        check_impl(impl, name)
        H, K, V = num_heads, head_dim, int(value_dim)
        self.d_model, self.num_heads, self.num_v_heads, self.head_dim, self.value_dim = d_model, H, HV, K, V
        self.conv_size, self.qk_norm, self.dtype = conv_size, qk_norm, dtype
        self.mode, self.chunk_size, self.impl = mode, chunk_size, impl
        n = self.num_householder = num_householder

        def linear(i, o, names=COLUMNS):
            return Linear(i, o, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                              kernel_metadata=axes(*names))

        self.q_proj, self.k_proj = linear(d_model, H * K), linear(d_model, n * H * K)
        self.v_proj = linear(d_model, n * HV * V)
        if conv_size:
            self.q_conv = ShortConvolution(H * K, conv_size, rngs=rngs)
            self.k_conv = ShortConvolution(n * H * K, conv_size, rngs=rngs)
            self.v_conv = ShortConvolution(n * HV * V, conv_size, rngs=rngs)
        self.g_proj = linear(d_model, HV * V) if use_output_gate else None
        self.o_norm = GatedRMSNorm(V, eps=norm_eps) if use_output_gate else RMSNorm(V, eps=norm_eps)
        self.o_proj = linear(HV * V, d_model, ROWS)

    def init_state(self, batch_size: int, max_len: int = 0) -> DeltaNetState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        recurrent = jnp.zeros((batch_size, self.num_v_heads, self.head_dim, self.value_dim), jnp.float32)
        return self.State(recurrent, *init_windows(self._convs(), batch_size, self.dtype))

    def _convs(self) -> tuple:
        return (self.q_conv, self.k_conv, self.v_conv) if self.conv_size else (None, None, None)

    def _mix(self, x, state, segment_ids, mode, steps: bool):  # state: self.State
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.value_dim
        x = x.astype(self.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        (q, k, v), windows = convolve(self._convs(), (q, k, v), (state.conv_q, state.conv_k, state.conv_v),
                                      segment_ids=segment_ids, steps=steps)
        if not self.conv_size:  # SiLU alone, as the convolutions end with
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        n = self.num_householder
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, n, H, K), v.reshape(B, T, n, HV, V)
        op, args = self._recurrence(q, k, v, x, segment_ids, mode)
        o, carry = stepwise(op, self._carry(state), *args) if steps else op(self._carry(state), *args)
        y = self.o_proj(self._output(o, x).reshape(B, T, HV * V))  # (B, T, D)
        carry = carry if isinstance(carry, tuple) else (carry,)
        return y, (self.State.stepped if steps else self.State)(*carry, *windows)

    def _carry(self, state):
        """What the op of `_recurrence` carries, from the layer's state: the delta-rule state (a subclass's op may
        carry a tuple, the state's fields before the windows)."""
        return state.recurrent

    def _recurrence(self, q, k, v, x, segment_ids, mode):
        """The state's op and its per-token inputs, (op(S, *args) -> (o, S), args), from the convolved q (B, T, H, K),
        k (B, T, n, H, K), v (B, T, n, HV, V) and the layer's input x: the delta rule of kernels/delta_rule."""
        q, k = normalize_qk(q, self.qk_norm), normalize_qk(k, self.qk_norm)
        if self.num_v_heads != self.num_heads:  # grouped value heads: q, k head j // r serves value head j
            r = self.num_v_heads // self.num_heads
            q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=3)  # (B, T, HV, K), (B, T, n, HV, K)
        beta, g = self._gates(x)  # beta (B, T, n*HV) float32; g (B, T, HV), (B, T, HV, K) or None
        op = lambda S, q, k, v, beta, g: delta_product(
            q, k, v, beta, g, segment_ids=segment_ids, initial_state=S, output_final_state=True, mode=mode,
            chunk_size=self.chunk_size, impl=self.impl)  # kernels/delta_rule/product.py; n = 1: delta_rule
        return op, (q, k, v, beta.reshape(*k.shape[:4]), g)

    def _output(self, o: Float[Array, "B T HV V"], x: Float[Array, "B T D"]) -> Float[Array, "B T HV V"]:
        """The per-head output norm, gated by SiLU(W_g x) when there is an output gate."""
        if self.g_proj is None:
            return self.o_norm(o)
        return self.o_norm(o, self.g_proj(x).reshape(o.shape))


class DeltaNet(DeltaRuleMixer):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with L2-normalised q, k (qk_norm "sum": divided
    by their sum instead); head_dim None = d_model / num_heads, values expand_v times as wide; conv_size: short
    convolutions on q, k, v (0 = none); use_beta: a learned write strength per token (else 1); use_output_gate: a swish
    output gate on the normed output (eps norm_eps); mode ("recurrent" | "chunk" | "parallel") picks the training path's
    exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path; dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 1.0,
                 conv_size: NonNegInt = 4, use_beta: bool = True, qk_norm: Annotated[str, OneOf("l2", "sum")] = "l2",
                 use_output_gate: bool = False, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk",
                 chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm=qk_norm, norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs)
        self.b_proj = gate_proj(d_model, num_heads, dtype, rngs) if use_beta else None

    def _gates(self, x):
        if self.b_proj is None:  # beta = 1: the plain delta rule of Schlag et al.
            return jnp.ones((*x.shape[:2], self.num_heads), jnp.float32), None
        return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), None


class GatedDeltaNet(DeltaRuleMixer):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the delta rule with a Mamba-2 decay; num_heads: the query/key
    heads; num_v_heads: the value heads (None = num_heads; a multiple of it: each query/key head serves num_v_heads /
    num_heads consecutive value heads, Qwen3-Next's linear_num_value_heads), each with its own beta, decay, gate and
    state; head_dim, expand_v, conv_size, use_output_gate, norm_eps as DeltaNet's; mode ("recurrent" | "chunk" |
    "parallel") picks the training path's exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" |
    "pallas") picks the op's implementation on every path; dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, num_v_heads: PosInt | None = None,
                 head_dim: PosInt | None = None, expand_v: PosFloat = 2.0, conv_size: NonNegInt = 4,
                 use_output_gate: bool = True, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64,
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm="l2", norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs, num_v_heads=num_v_heads)
        HV = self.num_v_heads
        self.a_proj, self.b_proj = gate_proj(d_model, HV, dtype, rngs), gate_proj(d_model, HV, dtype, rngs)
        self.A_log, self.dt_bias = decay_params(rngs, HV, HV, A_low=0.0)

    def _gates(self, x):
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]  # (B, T, HV)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a)  # log alpha_t
        return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), g


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Delta Attention (Kimi Team 2025, Kimi Linear): the gated delta rule with a decay per key channel from a
    low-rank projection, sigmoid output gate (module docstring); allow_neg_eigval: beta in (0, 2); gate_bias: the output
    gate's bias (fla's; False: transformers' Kimi Linear has none); head_dim, expand_v, conv_size, norm_eps as
    DeltaNet's; mode ("recurrent" | "chunk" | "parallel") picks the training path's exact form, chunk_size its chunk;
    impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype: the compute dtype
    (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 1.0,
                 conv_size: NonNegInt = 4, allow_neg_eigval: bool = False, gate_bias: bool = True,
                 norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=False, qk_norm="l2", norm_eps=norm_eps, mode=mode, chunk_size=chunk_size,
                         impl=impl, dtype=dtype, rngs=rngs)
        H, K, V = self.num_heads, self.head_dim, self.value_dim
        linear = lambda i, o, names, bias=False: Linear(i, o, use_bias=bias, dtype=dtype, rngs=rngs,
                                                        kernel_metadata=axes(*names), bias_metadata=axes(names[1]))
        self.f_down, self.f_up = linear(d_model, V, ("embed", None)), linear(V, H * K, (None, "heads"))
        self.g_down, self.g_up = linear(d_model, V, ("embed", None)), linear(V, H * V, (None, "heads"), bias=gate_bias)
        self.b_proj = gate_proj(d_model, H, dtype, rngs)
        self.A_log, self.dt_bias = decay_params(rngs, H, H * K, A_low=1.0)
        self.allow_neg_eigval = allow_neg_eigval

    def _gates(self, x):
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        return (2.0 * beta if self.allow_neg_eigval else beta), self._log_decay(x)

    def _log_decay(self, x: Float[Array, "B T D"]) -> Float[Array, "B T H K"]:
        """log alpha_t per key channel, float32."""
        B, T, _ = x.shape
        f = (self.f_up(self.f_down(x)).astype(jnp.float32) + self.dt_bias[...]).reshape(B, T, self.num_heads, -1)
        return -jnp.exp(self.A_log[...])[:, None] * jax.nn.softplus(f)

    def _output(self, o, x):
        gate = jax.nn.sigmoid(self.g_up(self.g_down(x)).astype(jnp.float32)).reshape(o.shape)
        return (self.o_norm(o).astype(jnp.float32) * gate).astype(o.dtype)  # RMSNorm(o) * sigmoid(W_g2 W_g1 x)


@state
class DeltaProductState(DeltaNetState):
    recurrent: Float[Array, "B H K V"]  # (B, H, K, V) float32 delta-rule state
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W _NHK"] | None  # (B, conv_size - 1, num_householder*H*K)
    conv_v: Float[Array, "B W _NHV"] | None  # (B, conv_size - 1, num_householder*H*V)


class GatedDeltaProduct(DeltaRuleMixer):
    """Gated DeltaProduct (Siems et al. 2025): num_householder delta-rule steps per token (each its own k, v, beta), the
    Gated DeltaNet decay once per token (use_forget_gate: False = none); run as T x num_householder sub-steps of the
    delta-rule op (chunk_size counts sub-steps); allow_neg_eigval: beta in (0, 2); head_dim, expand_v, conv_size,
    use_output_gate, norm_eps as DeltaNet's; mode ("recurrent" | "chunk" | "parallel") picks the training path's exact
    form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every
    path; dtype: the compute dtype (parameters stay float32)."""

    State = DeltaProductState

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 2.0,
                 num_householder: PosInt = 2, conv_size: NonNegInt = 4, use_forget_gate: bool = True,
                 allow_neg_eigval: bool = True, use_output_gate: bool = True, norm_eps: PosFloat = 1e-5,
                 mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if num_householder < 1:
            raise ValueError(f"GatedDeltaProduct: num_householder={num_householder} must be >= 1")
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm="l2", norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs,
                         num_householder=num_householder)
        H = num_heads
        self.b_proj = gate_proj(d_model, num_householder * H, dtype, rngs)
        self.a_proj = gate_proj(d_model, H, dtype, rngs) if use_forget_gate else None
        self.A_log, self.dt_bias = decay_params(rngs, H, H, A_low=0.0) if use_forget_gate else (None, None)
        self.allow_neg_eigval = allow_neg_eigval

    def _gates(self, x):
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))  # (B, T, n*H)
        beta = 2.0 * beta if self.allow_neg_eigval else beta
        if self.a_proj is None:
            return beta, None
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]  # (B, T, H)
        return beta, -jnp.exp(self.A_log[...]) * jax.nn.softplus(a)
