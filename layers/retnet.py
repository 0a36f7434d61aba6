"""Multi-scale retention, the token mixer of RetNet (Sun et al., 2023, "Retentive Network: A Successor to
Transformer for Large Language Models", gated multi-scale retention).

    Q = rot(X W_Q), K = rot(X W_K), V = X W_V                 per head h: K-dim q, k; V-dim v
    S_t = gamma_h S_{t-1} + k_t^T v_t,  o_t = K^-1/2 q_t S_t   gamma_h = 1 - 2^(-5 - h), h = 0..H-1
    Y = norm_h(o)                                             per head
    MSR(X) = (swish(X W_G) ⊙ Y) W_O

Dimensions follow the paper's parameter allocation: query/key width d_model (expand_k=1), value and
gate width 2 d_model (expand_v=2), so that with the FFN narrowed to 2 d_model a block keeps a
Transformer block's 12 d_model^2 parameters. The recurrence runs in kernels.retention (recurrent,
chunk or parallel, all equal); `impl` picks its implementation ("auto", "reference", "xla" or
"pallas", see kernels/retention) on every path: the training call, a multi-token decode and the
single-token decode step. impl="reference" runs the token-by-token scan whatever the mode;
impl="pallas" runs the GLA Pallas kernels with a scalar gate, whose chunk is their own block size
(mode and chunk_size are then unused): the Triton kernels on a GPU, the Mosaic ones
on a TPU (kernels.pallas_platform()).

Departures from the paper, named:
- positions: rotary embeddings (layers.rotary.apply_rotary, rotate-half layout, base `rotary_base`)
  instead of xPos, i.e. without xPos's extra exponential scaling of q and k; positions count inside
  each document, and the decode state keeps a (B,) position counter.
- norm: the paper's GroupNorm (one group per head) is an RMSNorm per head here, as in torchscale's
  later releases and flash-linear-attention: no mean subtraction, one weight vector of size V shared by
  all heads, fused with the swish gate (layers.norm.GatedRMSNorm).
- the parallel form drops the paper's row normalisations of the decay matrix and the scores: they
  rescale each query row of each head, which the per-head RMSNorm undoes (up to its eps).
- initialisation: Xavier-uniform with gain 2^-2.5 on every projection (torchscale's choice for W_Q,
  W_K, W_V, W_G; flash-linear-attention uses it for W_O as well, and so do we), no biases.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.retention import retention
from kernels.segments import positions_in_document
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm
from layers.options import Impl, Mode, PosFloat, PosInt
from layers.rotary import apply_rotary
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import per_token, state, stepwise


@state
class RetentionState:
    S: Float[Array, "B H K V"]  # (B, H, K, V) float32 retention state
    pos: Int[Array, " B"]  # (B,) position of the next token inside its document (rotary)


def _xavier(gain: float):
    return nnx.initializers.variance_scaling(gain ** 2, "fan_avg", "uniform")


class MultiScaleRetention(SequenceMixer):
    """Multi-scale retention (Sun et al. 2023): fixed per-head decay, rotary (rotary_base), norm (norm_eps) and swish
    gate; expand_k / expand_v: the query-key and value widths as multiples of d_model (the heads must divide both and
    the key head dim must be even); mode ("recurrent" | "chunk" | "parallel") picks the training path's exact form,
    chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path;
    dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, expand_k: PosFloat = 1.0, expand_v: PosFloat = 2.0,
                 rotary_base: PosFloat = 10000.0, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk",
                 chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        key_dim, value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide the key width {key_dim} (d_model * expand_k) "
                             f"and the value width {value_dim} (d_model * expand_v)")
        if (key_dim // num_heads) % 2:
            raise ValueError(f"the key head dim {key_dim // num_heads} must be even for rotary embeddings")
        check_mode(mode, chunk_size, "RetNet")
        check_impl(impl, "RetNet")
        self.d_model, self.num_heads, self.key_dim, self.value_dim = d_model, num_heads, key_dim, value_dim
        self.rotary_base, self.mode, self.chunk_size, self.dtype = rotary_base, mode, chunk_size, dtype
        self.impl = impl
        linear = lambda i, o, names=COLUMNS: Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs,
                                                        kernel_init=_xavier(2 ** -2.5), kernel_metadata=axes(*names))
        self.q_proj, self.k_proj = linear(d_model, key_dim), linear(d_model, key_dim)
        self.v_proj, self.g_proj = linear(d_model, value_dim), linear(d_model, value_dim)
        self.o_proj = linear(value_dim, d_model, ROWS)
        self.norm = GatedRMSNorm(value_dim // num_heads, eps=norm_eps)

    @property
    def gamma(self) -> np.ndarray:
        """Per-head decay 1 - 2^(-5 - h) (fixed, not trained)."""
        return 1.0 - 2.0 ** (-5.0 - np.arange(self.num_heads))

    def init_state(self, batch_size: int, max_len: int = 0) -> RetentionState:
        """max_len is ignored: the state has a fixed size."""
        H = self.num_heads
        return RetentionState(S=jnp.zeros((batch_size, H, self.key_dim // H, self.value_dim // H), jnp.float32),
                              pos=jnp.zeros((batch_size,), jnp.int32))

    def _mix(self, x, state: RetentionState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H = self.num_heads
        x = x.astype(self.dtype)
        pos = positions_in_document(segment_ids, B, T, start=state.pos)  # (B, T)
        q = apply_rotary(self.q_proj(x).reshape(B, T, H, -1), pos, self.rotary_base)  # (B, T, H, K)
        k = apply_rotary(self.k_proj(x).reshape(B, T, H, -1), pos, self.rotary_base)
        v = self.v_proj(x).reshape(B, T, H, -1)  # (B, T, H, V)
        op = lambda S, q, k, v: retention(q, k, v, jnp.asarray(self.gamma, jnp.float32), segment_ids=segment_ids,
                                          initial_state=S, output_final_state=True, mode=mode,
                                          chunk_size=self.chunk_size, impl=self.impl)
        o, S = stepwise(op, state.S, q, k, v) if steps else op(state.S, q, k, v)
        o = self.norm(o, self.g_proj(x).reshape(B, T, H, -1))  # RMSNorm per head, times swish(gate)
        y = self.o_proj(o.reshape(B, T, self.value_dim))
        return y, (RetentionState.stepped if steps else RetentionState)(S=S, pos=per_token(pos + 1, steps))
