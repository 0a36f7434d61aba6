"""MesaNet token mixer (von Oswald et al. 2025, "MesaNet: Sequence Modeling by Locally Optimal Test-Time
Training", arXiv 2506.05233), as flash-linear-attention's `MesaNet` layer computes it. Per head, the output
is the prediction of a ridge regression fitted, at every token, to all the (key, value) pairs so far:

    q_t = norm(SiLU(conv(W_q x)_t)),  k_t = norm(SiLU(conv(W_k x)_t)),  v_t = W_v x_t     (norm: L2)
    gamma_t = sigmoid(w_a . x_t + b_a),  beta_t = sigmoid(w_b . x_t + b_b),  lambda = softplus(l) + lambda_min
    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T,    G_t = gamma_t G_{t-1} + beta_t k_t v_t^T
    o_t = G_t^T (H_t + diag(lambda))^{-1} q_t    (cg_steps iterations of conjugate gradients, kernels/mesa)
    y_t = W_o RMSNorm(o_t)                         or W_o [RMSNorm(o_t) * SiLU(W_g x_t)] (use_output_gate)

The solve is the layer's only non-linearity in the state: the state (H_t, G_t) is two gated linear-attention
states, so training runs the CG iterations with each product H_t p a GLA pass (kernels/mesa/chunk.py).

Code names: `num_heads` H, `head_dim` K = V; `a_proj` (w_a, b_a), `b_proj` (w_b, b_b), `lambda_param` l
(H K, one lambda per key channel), `lambda_min` fla's lambda_lower_bound, `cg_steps` the CG iterations.
Decode state: H (B, H, K, K) and G (B, H, K, V) float32 plus the q and k convolutions' windows.

Departures from fla, named: one CG count for training and decoding (fla: max_cg_step_training and
max_cg_step_decoding, 30 each) and one start, x_0 = 0, in every form (fla's decoding step starts from the
Jacobi guess q / (diag(H_t) + lambda), its training kernels from 0: the same solution in the limit, not the
same numbers after finitely many steps); the CG count defaults to 10 (fla: 30) for CPU training cost,
the config's to choose; initialisation: the zoo's Linear default; lambda starts at 1 as fla.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.mesa import mesa
from layers.conv import ShortConvolution, convolve, init_windows
from layers.deltanet import gate_proj, normalize_qk
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm, RMSNorm
from layers.options import Impl, Mode, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class MesaState:
    Hk: Float[Array, "B H K K"]  # (B, H, K, K) float32: the gated sum of beta k k^T
    G: Float[Array, "B H K V"]  # (B, H, K, V) float32: the gated sum of beta k v^T
    conv_q: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)
    conv_k: Float[Array, "B W H*K"]  # (B, conv_size - 1, H*K)


class MesaNet(SequenceMixer):
    """MesaNet (von Oswald et al. 2025): per head the ridge-regression prediction G_t^T (H_t + diag(lambda))^-1 q_t of
    the gated key/value sums, solved by cg_steps conjugate-gradient iterations; lambda = softplus(.) + lambda_min per
    key channel (starts at 1); head_dim None = d_model / num_heads; conv_size: the q and k short convolutions;
    use_output_gate: a swish gate on the normed output (eps norm_eps); mode ("recurrent" | "chunk" | "parallel") picks
    the training path's exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the
    op's implementation on every path (the GLA op's for the products); dtype: the compute dtype (parameters stay
    float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, conv_size: PosInt = 4,
                 cg_steps: PosInt = 10, lambda_min: PosFloat = 0.25, use_output_gate: bool = False,
                 norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if head_dim is None and d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model} (or give head_dim)")
        if conv_size < 1:
            raise ValueError(f"conv_size={conv_size} must be >= 1")
        if lambda_min >= 1:
            raise ValueError(f"lambda_min={lambda_min} must be below lambda's initial value 1")
        check_mode(mode, chunk_size, "MesaNet")
        check_impl(impl, "MesaNet")
        H, K = num_heads, head_dim or d_model // num_heads
        self.d_model, self.num_heads, self.head_dim = d_model, H, K
        self.cg_steps, self.lambda_min = cg_steps, lambda_min
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.q_proj, self.k_proj, self.v_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, H * K)
        self.q_conv, self.k_conv = (ShortConvolution(H * K, conv_size, rngs=rngs) for _ in range(2))
        self.a_proj, self.b_proj = (gate_proj(d_model, H, dtype, rngs, bias=True) for _ in range(2))
        start = math.log(math.expm1(1.0 - lambda_min))  # softplus^-1(1 - lambda_min): lambda starts at 1
        self.lambda_param = nnx.Param(jnp.full((H * K,), start, jnp.float32), **axes("heads"))
        self.g_proj = linear(d_model, H * K) if use_output_gate else None
        self.o_norm = GatedRMSNorm(K, eps=norm_eps) if use_output_gate else RMSNorm(K, eps=norm_eps)
        self.o_proj = linear(H * K, d_model, ROWS)

    def init_state(self, batch_size: int, max_len: int = 0) -> MesaState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        H, K = self.num_heads, self.head_dim
        zeros = jnp.zeros((batch_size, H, K, K), jnp.float32)
        return MesaState(zeros, zeros, *init_windows((self.q_conv, self.k_conv), batch_size, self.dtype))

    def _mix(self, x, state: MesaState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        x = x.astype(self.dtype)
        (q, k), windows = convolve((self.q_conv, self.k_conv), (self.q_proj(x), self.k_proj(x)),
                                   (state.conv_q, state.conv_k), segment_ids=segment_ids, steps=steps)
        q, k = (normalize_qk(a.reshape(B, T, H, K), "l2") for a in (q, k))  # (B, T, H, K)
        v = self.v_proj(x).reshape(B, T, H, K)
        g = jax.nn.log_sigmoid(self.a_proj(x).astype(jnp.float32))  # (B, T, H) log gamma_t
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        lamb = (jax.nn.softplus(self.lambda_param[...]) + self.lambda_min).reshape(H, K)
        op = lambda S, q, k, v, g, beta: mesa(q, k, v, g, beta, lamb, cg_steps=self.cg_steps, segment_ids=segment_ids,
                                              initial_state=S, output_final_state=True, mode=mode,
                                              chunk_size=self.chunk_size, impl=self.impl)
        args = ((state.Hk, state.G), q, k, v, g, beta)
        o, (Hk, G) = stepwise(op, *args) if steps else op(*args)  # o: (B, T, H, K)
        o = self.o_norm(o) if self.g_proj is None else self.o_norm(o, self.g_proj(x).reshape(o.shape))
        y = self.o_proj(o.reshape(B, T, H * K))
        return y, (MesaState.stepped if steps else MesaState)(Hk, G, *windows)
