"""DeltaNet and Gated DeltaNet token mixers.

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

Code names: `num_heads` H, `head_dim` K (query/key width per head), `expand_v` V / K,
`b_proj` w_beta, `a_proj` w_a, `g_proj` W_g, `o_norm` the per-head output RMSNorm (weights shared
across heads, as in fla), `impl` the op's implementation ("auto", "reference", "xla" or "pallas", see
kernels/delta_rule) on every path: the training call, a multi-token decode and the single-token
step; impl="pallas" runs the Pallas kernels, whose chunk is their own block size (mode and
chunk_size are then unused): the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).
Decode state: the H x K x V delta-rule state plus the last conv_size - 1 inputs of each short
convolution (fla's `conv_state`).

Departures, all named: the key width is set by `head_dim` (default d_model / num_heads) instead of
fla DeltaNet's `expand_k` (the same width at the default expand_k = 1); `conv_size=0` replaces fla's
`use_short_conv=False` (SiLU without convolution, as fla does then); no `allow_neg_eigval`, no
grouped value heads (`num_v_heads`) and no qk activations other than SiLU.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.delta_rule import delta_rule
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.norm import GatedRMSNorm, RMSNorm
from layers.shapes import check_input
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import check_steps, rollback, state, stepwise


@state
class DeltaNetState:
    recurrent: Float[Array, "B H K V"]  # (B, H, K, V) float32 delta-rule state
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W H*V"] | None  # (B, conv_size - 1, H*V)


def _normalize(x: Float[Array, "B T H K"], kind: str) -> Float[Array, "B T H K"]:
    x32 = x.astype(jnp.float32)
    if kind == "l2":
        y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)  # fla's l2norm eps
    else:  # "sum"
        y = x32 / jnp.sum(x32, axis=-1, keepdims=True)
    return y.astype(x.dtype)


class _DeltaRuleMixer(nnx.Module):
    """The body both layers share; subclasses add their gate parameters and `_gates(x) -> (beta, g)`."""

    def __init__(self, d_model, *, num_heads, head_dim, expand_v, conv_size, use_output_gate, qk_norm,
                 norm_eps, mode, chunk_size, impl, dtype, rngs, name):
        if num_heads < 1 or d_model < 1:
            raise ValueError(f"{name}: num_heads={num_heads} and d_model={d_model} must be positive")
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
        self.d_model, self.num_heads, self.head_dim, self.value_dim = d_model, H, K, V
        self.conv_size, self.qk_norm, self.dtype = conv_size, qk_norm, dtype
        self.mode, self.chunk_size, self.impl = mode, chunk_size, impl

        def linear(i, o, names=COLUMNS):
            return Linear(i, o, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                              kernel_metadata=axes(*names))

        self.q_proj, self.k_proj, self.v_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, H * V)
        if conv_size:
            self.q_conv = ShortConvolution(H * K, conv_size, rngs=rngs)
            self.k_conv = ShortConvolution(H * K, conv_size, rngs=rngs)
            self.v_conv = ShortConvolution(H * V, conv_size, rngs=rngs)
        self.g_proj = linear(d_model, H * V) if use_output_gate else None
        self.o_norm = GatedRMSNorm(V, eps=norm_eps) if use_output_gate else RMSNorm(V, eps=norm_eps)
        self.o_proj = linear(H * V, d_model, ROWS)

    def init_state(self, batch_size: int, max_len: int = 0) -> DeltaNetState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        recurrent = jnp.zeros((batch_size, self.num_heads, self.head_dim, self.value_dim), jnp.float32)
        if not self.conv_size:
            return DeltaNetState(recurrent, None, None, None)
        convs = (c.init_state(batch_size, self.dtype) for c in (self.q_conv, self.k_conv, self.v_conv))
        return DeltaNetState(recurrent, *convs)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        return self._mix(x, self.init_state(x.shape[0]), segment_ids, self.mode)[0]

    def decode(self, x: Float[Array, "B T D"], state: DeltaNetState, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T D"], DeltaNetState]:
        """Prefill (T > 1, chunk form) or one step (T = 1, the recurrence), continuing from `state`;
        steps=True returns the state after every token, for `rollback` (layers/state.py)."""
        check_steps(steps, segment_ids, type(self).__name__)
        return self._mix(x, state, segment_ids, "chunk" if x.shape[1] > 1 and not steps else "recurrent", steps)

    def rollback(self, stepped: DeltaNetState, drop: Int[Array, " B"]) -> DeltaNetState:
        return rollback(stepped, drop)

    def _mix(self, x, state: DeltaNetState, segment_ids, mode, steps: bool = False):
        check_input(x, self.d_model, segment_ids, type(self).__name__)
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_dim, self.value_dim
        x = x.astype(self.dtype)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.conv_size:
            q, conv_q = self.q_conv.decode(q, state.conv_q, segment_ids=segment_ids, steps=steps)
            k, conv_k = self.k_conv.decode(k, state.conv_k, segment_ids=segment_ids, steps=steps)
            v, conv_v = self.v_conv.decode(v, state.conv_v, segment_ids=segment_ids, steps=steps)
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
            conv_q = conv_k = conv_v = None
        q = _normalize(q.reshape(B, T, H, K), self.qk_norm)  # (B, T, H, K)
        k = _normalize(k.reshape(B, T, H, K), self.qk_norm)
        v = v.reshape(B, T, H, V)  # (B, T, H, V)
        beta, g = self._gates(x)  # (B, T, H) float32, g None for plain DeltaNet
        op = lambda S, q, k, v, beta, g: delta_rule(q, k, v, beta, g, segment_ids=segment_ids, initial_state=S,
                                                    output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                                    impl=self.impl)
        args = (state.recurrent, q, k, v, beta, g)
        o, recurrent = stepwise(op, *args) if steps else op(*args)
        if self.g_proj is not None:
            o = self.o_norm(o, self.g_proj(x).reshape(B, T, H, V))
        else:
            o = self.o_norm(o)
        y = self.o_proj(o.reshape(B, T, H * V))  # (B, T, D)
        return y, (DeltaNetState.stepped if steps else DeltaNetState)(recurrent, conv_q, conv_k, conv_v)


class DeltaNet(_DeltaRuleMixer):
    def __init__(self, d_model: int, *, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 1.0,
                 conv_size: int = 4, use_beta: bool = True, qk_norm: str = "l2", use_output_gate: bool = False,
                 norm_eps: float = 1e-5, mode: str = "chunk", chunk_size: int = 64, impl: str = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm=qk_norm, norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs, name="DeltaNet")
        self.b_proj = Linear(d_model, num_heads, use_bias=False, dtype=dtype, rngs=rngs,
                                 kernel_metadata=axes("embed", None)) if use_beta else None

    def _gates(self, x):
        if self.b_proj is None:  # beta = 1: the plain delta rule of Schlag et al.
            return jnp.ones((*x.shape[:2], self.num_heads), jnp.float32), None
        return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), None


class GatedDeltaNet(_DeltaRuleMixer):
    def __init__(self, d_model: int, *, num_heads: int = 4, head_dim: int | None = None, expand_v: float = 2.0,
                 conv_size: int = 4, use_output_gate: bool = True, norm_eps: float = 1e-5, mode: str = "chunk",
                 chunk_size: int = 64, impl: str = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm="l2", norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs, name="GatedDeltaNet")
        H = num_heads
        gate = lambda: Linear(d_model, H, use_bias=False, dtype=dtype, rngs=rngs,
                                  kernel_metadata=axes("embed", None))
        self.a_proj, self.b_proj = gate(), gate()
        A = 16.0 * (1.0 - jax.random.uniform(rngs.params(), (H,)))  # U(0, 16], never 0
        self.A_log = nnx.Param(jnp.log(A))
        log_dt = jax.random.uniform(rngs.params(), (H,), minval=jnp.log(1e-3), maxval=jnp.log(1e-1))
        dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # softplus^-1(dt)

    def _gates(self, x):
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]  # (B, T, H)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a)  # log alpha_t
        return jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)), g
