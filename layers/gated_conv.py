"""LFM2's gated short convolution (Amini et al. 2025, Liquid AI, "LFM2 Technical Report", arXiv 2511.23404: the
operator of its conv blocks, as transformers' Lfm2ShortConv computes it):

    [b_t, c_t, h_t] = x_t W_in + b_in               three D-wide projections of the input
    u_t = b_t ⊙ h_t                                  input gate
    z_t = sum_{j=0}^{W-1} w_j ⊙ u_{t-W+1+j} + b_conv  causal depthwise convolution, W = kernel_size taps
    y_t = (c_t ⊙ z_t) W_out + b_out                  output gate

Gate, convolve, gate: the shape of an order-2 Hyena operator as the official Hyena code gates it (Poli et al.
2023), with one short filter in place of the long one and no activation on the convolution (`base_conv`
applies silu and gates once). It mixes only kernel_size neighbouring tokens; LFM2 places it between a few
attention layers. Code name -> symbol: `w_in` W_in as (D, 3, D) for (b, c, h) (transformers' in_proj.weight,
its rows in that order), `b_in` b_in, `conv` w and b_conv (layers/conv.py), `out_proj` W_out and b_out.
No departure from transformers' function; the initialisation is the zoo's (normal 1/sqrt(D) for W_in,
Flax's for W_out, PyTorch's uniform for the taps, zero biases).

Options: kernel_size (W, LFM2's conv_L_cache); bias (b_in, b_conv and b_out together, as LFM2's
conv_bias: all three or none).

The decode state is the convolution's window, (B, kernel_size - 1, D) of past u (layers/conv.py, which
also keeps packed documents apart): constant in the context.
"""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from layers.conv import ShortConvolution
from layers.linear import Linear, project
from layers.mixer import SequenceMixer
from layers.options import PosInt
from layers.sharding import ROWS, axes
from layers.state import state


@state
class GatedConvState:
    conv: Float[Array, "B W D"]  # (B, kernel_size - 1, D) the convolution's last inputs u


class GatedConv(SequenceMixer):
    """LFM2's gated short convolution (Amini et al. 2025): y = (c * conv(b * h)) W_out with [b, c, h] = x W_in, a causal
    depthwise conv of kernel_size taps without activation; bias: biases on W_in, the conv and W_out (LFM2's
    conv_bias); dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True  # a short convolution: XLA passes each span its left neighbour's last inputs

    def __init__(self, d_model: int, *, kernel_size: PosInt = 3, bias: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if kernel_size < 1:
            raise ValueError(f"kernel_size={kernel_size} must be >= 1")
        D = self.d_model = d_model
        self.dtype = dtype
        # (D, 3, D): b, c and h apart, so each is split over `tensor` by its channels as the conv is
        self.w_in = nnx.Param(nnx.initializers.normal(D ** -0.5)(rngs.params(), (D, 3, D)),
                              **axes("embed", None, "heads"))
        self.b_in = nnx.Param(jnp.zeros((3, D), jnp.float32), **axes(None, "heads")) if bias else None
        self.conv = ShortConvolution(D, kernel_size, activation=False, use_bias=bias, rngs=rngs)
        self.out_proj = Linear(D, D, use_bias=bias, dtype=dtype, rngs=rngs, kernel_metadata=axes(*ROWS),
                               bias_metadata=axes("embed"))

    def init_state(self, batch_size: int, max_len: int = 0) -> GatedConvState:
        """max_len is ignored: the state has a fixed size."""
        return GatedConvState(conv=self.conv.init_state(batch_size, self.dtype))

    def _mix(self, x, state: GatedConvState, segment_ids, mode, steps: bool):
        """One form (mode unused); steps=True keeps the window after every token, (T, B, W, D)."""
        bch = project(x.astype(self.dtype), self.w_in[...].astype(self.dtype))  # (B, T, 3, D)
        if self.b_in is not None:
            bch = bch + self.b_in[...].astype(self.dtype)
        b, c, h = bch[:, :, 0], bch[:, :, 1], bch[:, :, 2]  # (B, T, D) each
        z, conv = self.conv.decode(b * h, state.conv, segment_ids=segment_ids, steps=steps)
        return self.out_proj(c * z), (GatedConvState.stepped if steps else GatedConvState)(conv=conv)
