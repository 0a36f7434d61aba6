"""Lightning attention, the linear-attention token mixer of MiniMax-01 (MiniMax 2025, "MiniMax-01: Scaling
Foundation Models with Lightning Attention"; Qin et al. 2024, "Lightning Attention-2"), as transformers'
`MiniMaxLightningAttention` computes it.

    q, k, v = split_h(SiLU(x W_qkv))                          per head h: Dh-dim q, k, v
    S_t = λ_h S_{t-1} + k_t v_t^T,   o_t = q_t S_t             no 1/sqrt(Dh): the norm below sets the scale
    λ_h = exp(-s_h),  s_h = 2^(-8 (h + 1) / H) (1 - l / (L - 1 + 1e-5) + 1e-5)    fixed, ALiBi's slopes
    y_t = (σ(x_t W_g) ⊙ RMSNorm(o_t over all heads)) W_o

This is retention with a fixed per-head decay and scale 1, so it runs through kernels/retention in every
mode and implementation (recurrent, chunk, parallel; GLA's Pallas kernels with `impl: pallas`), with no op
of its own. Lightning attention's own contribution is the tiling of that chunk form on a GPU (intra-block
quadratic, inter-block through the state): kernels/retention/chunk.py is the same split in XLA.

Code names: `num_heads` H, `head_dim` Dh, `qkv_proj` W_qkv (each head's q, k, v side by side, the
checkpoint's layout), `gate_proj` W_g, `o_proj` W_o, `norm` the RMSNorm over H*Dh, `slope` s_h, `layer_id` l,
`num_layers` L (the model's depth, as the decay schedule needs it: the last layer barely decays).

Departures, named:
- The block: MiniMax-01 scales the residual branches (layernorm_*_alpha / beta) and interleaves softmax
  attention every eighth layer; here the mixer alone, in the zoo's pre-norm block (`model.layer_pattern`
  gives the interleave).
- Initialisation: the zoo's Linear default.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.retention import retention
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, Mode, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state, stepwise


@state
class LightningState:
    S: Float[Array, "B H K V"]  # (B, H, Dh, Dh) float32 state


class LightningAttention(SequenceMixer):
    """Lightning attention (MiniMax-01): SiLU linear attention with a fixed per-head decay exp(-s_h) on ALiBi's slopes
    scaled down with depth (layer_id / num_layers: the last layer barely decays), an RMSNorm over the heads and a
    sigmoid output gate; num_heads divides d_model unless head_dim is given; norm_eps: the output norm's; mode
    ("recurrent" | "chunk" | "parallel") picks the training path's exact form, chunk_size its chunk; impl ("auto" |
    "reference" | "xla" | "pallas") picks the retention op's implementation on every path; dtype: the compute dtype
    (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None,
                 norm_eps: PosFloat = 1e-6, layer_id: int = 0, num_layers: int = 1, mode: Mode = "chunk",
                 chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if head_dim is None and d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model} (or give head_dim)")
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"LightningAttention: layer_id={layer_id} must be in [0, num_layers={num_layers})")
        check_mode(mode, chunk_size, "LightningAttention")
        check_impl(impl, "LightningAttention")
        H, Dh = num_heads, head_dim or d_model // num_heads
        self.d_model, self.num_heads, self.head_dim = d_model, H, Dh
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype
        self.depth_factor = 1 - layer_id / (num_layers - 1 + 1e-5) + 1e-5
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                    kernel_metadata=axes(*names))
        self.qkv_proj, self.gate_proj = linear(d_model, 3 * H * Dh), linear(d_model, H * Dh)
        self.o_proj = linear(H * Dh, d_model, ROWS)
        self.norm = RMSNorm(H * Dh, eps=norm_eps)

    @property
    def slope(self) -> np.ndarray:
        """s_h (fixed, not trained)."""
        H = self.num_heads
        return 2.0 ** (-8.0 * (np.arange(H) + 1) / H) * self.depth_factor

    def init_state(self, batch_size: int, max_len: int = 0) -> LightningState:
        """A zero state; max_len is ignored (the state does not grow with context)."""
        Dh = self.head_dim
        return LightningState(jnp.zeros((batch_size, self.num_heads, Dh, Dh), jnp.float32))

    def _mix(self, x, state: LightningState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        x = x.astype(self.dtype)
        qkv = jax.nn.silu(self.qkv_proj(x)).reshape(B, T, self.num_heads, 3, self.head_dim)  # (B, T, H, 3, Dh)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # (B, T, H, Dh)
        gamma = jnp.asarray(np.exp(-self.slope), jnp.float32)
        op = lambda S, q, k, v: retention(q, k, v, gamma, segment_ids=segment_ids, initial_state=S,
                                          output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                          impl=self.impl, scale=1.0)
        o, S = stepwise(op, state.S, q, k, v) if steps else op(state.S, q, k, v)  # o: (B, T, H, Dh)
        o = self.norm(o.reshape(B, T, -1)) * jax.nn.sigmoid(self.gate_proj(x))  # (B, T, H*Dh)
        return self.o_proj(o), (LightningState.stepped if steps else LightningState)(S)
