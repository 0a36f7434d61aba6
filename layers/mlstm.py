"""The mLSTM layer of xLSTM (Beck et al., 2024, "xLSTM: Extended Long Short-Term Memory", sec. 2.3 and
fig. 10, the mLSTM block), as the official xlstm's `mLSTMLayer` computes it:

    x_m, z = split(x W_up)                              up-projection by proj_factor, two branches
    c_t = SiLU(conv(x_m)_t)                             causal conv of width conv_size
    q_t = c_t W_q,  k_t = c_t W_k,  v_t = x_m,t W_v      block-diagonal (qkv_blocksize) projections
    ĩ_t, f̃_t = [q_t, k_t, v_t] w_i + b_i, [q_t, k_t, v_t] w_f + b_f     one scalar each per head
    h_t = mLSTM cell (kernels/mlstm: m, C, n with the max stabiliser; log f = logsigmoid(f̃))
    y_t = ((MultiHeadLayerNorm(h_t) + s ⊙ c_t) ⊙ SiLU(z_t)) W_down

The model's block is pre-norm residual with no FFN (`ffn: {kind: none}`), the xLSTM mLSTM block: the
up-projection inside the layer stands in for the FFN.

Code names: `proj_up` W_up (d_model x 2 Di, Di = proj_factor * d_model), `conv` the causal conv (with
bias, SiLU), `q_proj`, `k_proj`, `v_proj` W_q, W_k, W_v (Di / qkv_blocksize diagonal blocks of
qkv_blocksize x qkv_blocksize, xlstm's LinearHeadwiseExpand), `igate` / `fgate` (w_i, b_i) / (w_f, b_f)
from the 3 Di concatenation, `norm_weight` the per-head LayerNorm's weight (no bias), `skip` s (the
learnable skip, ones), `proj_down` W_down. num_heads H, head dim K = V = Di / H. `mode` picks the
cell's exact form (recurrent, chunk, parallel); `impl` its implementation ("auto", "reference", "xla";
no Pallas kernel). Decode state: the cell's (C (B, H, K, V), n (B, H, K), m (B, H)) float32 and the
conv's last conv_size - 1 inputs.

Initialisation as the official code: W_up, W_q, W_k, W_v normal with std sqrt(2 / (5 d_model))
(small_init), W_down std 2 / (num_layers sqrt(d_model)) (wang_init), gate weights zero, b_f linearly
spaced in [3, 6] over the heads, b_i normal(0, 0.1), norm weight and skip ones.

Departures from the official code, named:
- Di = proj_factor * d_model exactly (xlstm rounds it up to a multiple of 64);
- no eps in the cell's denominator (kernels/mlstm/reference.py), and the cell supports packed
  documents and an entering state in every form (the official parallel form starts from zero);
- the conv's window and the cell restart at document starts (segment_ids), as every zoo layer;
- conv_size = 0 drops the conv (c_t = SiLU(x_m,t)); the official kernel size 0 does the same;
- the block's pre-norm is the model's (`model.norm`; configs/mlstm.yaml: LayerNorm with a bias, where
  xlstm's has none); the norm weight is stored as w (init 1), not xlstm's 1 + w (init 0): the same
  function; no dropout.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.mlstm import mlstm
from layers.conv import ShortConvolution, convolve, init_windows
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import head_group_norm
from layers.options import Impl, Mode, NonNegInt, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class MLSTMState:
    C: Float[Array, "B H K V"]  # (B, H, K, V) float32 matrix memory (stabilised by m)
    n: Float[Array, "B H K"]  # (B, H, K) float32 normaliser
    m: Float[Array, "B H"]  # (B, H) float32 max stabiliser
    conv: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, Di) conv window; None when conv_size = 0


class BlockDiagonal(nnx.Module):
    """x W with W block-diagonal: blocks of `block` x `block` channels (xlstm's LinearHeadwiseExpand, no bias)."""

    def __init__(self, dim: int, block: int, *, std: float, rngs: nnx.Rngs):
        init = nnx.initializers.normal(std)
        self.weight = nnx.Param(init(rngs.params(), (dim // block, block, block)), **axes("heads", None, None))

    def __call__(self, x: Float[Array, "B T F"]) -> Float[Array, "B T F"]:
        nb, bs, _ = self.weight.shape
        xb = x.reshape(*x.shape[:-1], nb, bs)  # (B, T, F / bs, bs)
        return jnp.einsum("btni,noi->btno", xb, self.weight[...].astype(x.dtype)).reshape(x.shape)


class MLSTM(SequenceMixer):
    """xLSTM's mLSTM layer (Beck et al. 2024): up-projection by proj_factor into a cell branch (causal conv of width
    conv_size, 0 = none, + SiLU; block-diagonal q, k, v projections of qkv_blocksize; exponential input and sigmoid
    forget gates per head; matrix memory with normaliser and max stabiliser; per-head LayerNorm with eps norm_eps;
    learnable skip) and a SiLU output-gate branch, then a down-projection; num_heads must divide the inner width
    proj_factor * d_model; mode ("recurrent" | "chunk" | "parallel") picks the cell's exact form, chunk_size its
    chunk; impl ("auto" | "reference" | "xla"; no Pallas kernel) its implementation; dtype: the compute dtype
    (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, proj_factor: PosFloat = 2.0, qkv_blocksize: PosInt = 4,
                 conv_size: NonNegInt = 4, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64,
                 impl: Impl = "auto", num_layers: int = 1, dtype=jnp.float32, rngs: nnx.Rngs):
        inner = proj_factor * d_model
        if inner != int(inner) or inner < 1:
            raise ValueError(f"proj_factor={proj_factor} times d_model={d_model} must be a positive integer (the inner "
                             "width)")
        inner = int(inner)
        if inner % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the inner width {inner} (proj_factor * d_model)")
        if inner % qkv_blocksize:
            raise ValueError(f"qkv_blocksize={qkv_blocksize} must divide the inner width {inner} (proj_factor * "
                             "d_model)")
        if conv_size < 0:
            raise ValueError(f"conv_size={conv_size} must be >= 0 (0 = no causal convolution)")
        check_mode(mode, chunk_size, "MLSTM")
        check_impl(impl, "MLSTM")
        if impl == "pallas":
            raise ValueError("impl='pallas' has no mLSTM kernel; expected 'auto', 'reference' or 'xla'")
        self.d_model, self.num_heads, self.inner, self.conv_size = d_model, num_heads, inner, conv_size
        self.norm_eps, self.mode, self.chunk_size, self.impl, self.dtype = norm_eps, mode, chunk_size, impl, dtype
        small = (2 / (5 * d_model)) ** 0.5  # xlstm's small_init
        self.proj_up = Linear(d_model, 2 * inner, use_bias=False, dtype=dtype, rngs=rngs,
                              kernel_init=nnx.initializers.normal(small), kernel_metadata=axes(*COLUMNS))
        self.q_proj, self.k_proj, self.v_proj = (BlockDiagonal(inner, qkv_blocksize, std=small, rngs=rngs)
                                                 for _ in range(3))
        self.conv = ShortConvolution(inner, conv_size, activation=True, use_bias=True, rngs=rngs) if conv_size else None
        H = num_heads
        f_bias = lambda key, shape, dtype=jnp.float32: jnp.linspace(3.0, 6.0, shape[0], dtype=dtype)
        i_bias = nnx.initializers.normal(0.1)
        gate = lambda bias_init: Linear(3 * inner, H, use_bias=True, dtype=dtype, rngs=rngs,
                                        kernel_init=nnx.initializers.zeros, bias_init=bias_init,
                                        kernel_metadata=axes("heads", None))
        self.igate, self.fgate = gate(i_bias), gate(f_bias)
        self.norm_weight = nnx.Param(jnp.ones((inner,), jnp.float32), **axes("heads"))
        self.skip = nnx.Param(jnp.ones((inner,), jnp.float32), **axes("heads"))
        self.proj_down = Linear(inner, d_model, use_bias=False, dtype=dtype, rngs=rngs,
                                kernel_init=nnx.initializers.normal(2 / num_layers / d_model ** 0.5),
                                kernel_metadata=axes(*ROWS))

    def init_state(self, batch_size: int, max_len: int = 0) -> MLSTMState:
        """The zero state (C = 0, n = 0, m = 0) and window; max_len is ignored: the state has a fixed size."""
        H, K = self.num_heads, self.inner // self.num_heads
        zeros = lambda *shape: jnp.zeros((batch_size, *shape), jnp.float32)
        return MLSTMState(zeros(H, K, K), zeros(H, K), zeros(H), *init_windows((self.conv,), batch_size, self.dtype))

    def _mix(self, x, state: MLSTMState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H = self.num_heads
        x_m, z = jnp.split(self.proj_up(x.astype(self.dtype)), 2, axis=-1)  # (B, T, Di) each
        (c,), windows = convolve((self.conv,), (x_m,), (state.conv,), segment_ids=segment_ids, steps=steps)
        c = c if self.conv is not None else jax.nn.silu(x_m)
        q, k, v = self.q_proj(c), self.k_proj(c), self.v_proj(x_m)  # (B, T, Di)
        qkv = jnp.concatenate([q, k, v], axis=-1)  # (B, T, 3 Di)
        i_pre, f_pre = self.igate(qkv).astype(jnp.float32), self.fgate(qkv).astype(jnp.float32)  # (B, T, H)
        q, k, v = (a.reshape(B, T, H, -1) for a in (q, k, v))  # (B, T, H, K)
        op = lambda S, q, k, v, i_pre, f_pre: mlstm(q, k, v, i_pre, f_pre, segment_ids=segment_ids, initial_state=S,
                                                    output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                                    impl=self.impl)
        cell = (state.C, state.n, state.m)
        h, (C, n, m) = stepwise(op, cell, q, k, v, i_pre, f_pre) if steps else op(cell, q, k, v, i_pre, f_pre)
        h = head_group_norm(h, self.norm_weight[...], 0.0, self.norm_eps)  # (B, T, Di) float32
        h = (h + self.skip[...] * c.astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        y = self.proj_down(h.astype(self.dtype))
        return y, (MLSTMState.stepped if steps else MLSTMState)(C, n, m, *windows)
