"""Based's gated short convolution, BaseConv (Arora et al., 2024, "Simple linear attention language
models balance the recall-throughput tradeoff"; the gated convolution of Arora et al., 2023, Zoology).

    [u_t, g_t] = x_t W_in + b_in                u, g in R^{Di}, Di = expand * d_model / 2
    y_t = (silu(conv(u)_t) ⊙ g_t) W_out + b_out  conv: a short causal depthwise convolution over time

as the official BaseConv (expand_proj = 4 there, so Di = 2 d_model; kernel size 3; no conv bias). It
mixes only kernel_size neighbouring tokens: Based's cheap local mixer beside its linear attention
and sliding-window attention. The decode state is the convolution's window, (B, kernel_size - 1, Di)
(layers/conv.py, which also keeps documents apart).
"""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.options import PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import state


@state
class BaseConvState:
    conv: Float[Array, "B W _Di"]  # (B, kernel_size - 1, Di) the convolution's last inputs


class BaseConv(SequenceMixer):
    """Based's gated short convolution (Arora et al. 2024): y = (silu(conv(u)) * g) W_out with [u, g] = x W_in, u and g
    expand * d_model / 2 wide, a causal depthwise conv of kernel_size taps; dtype: the compute dtype (parameters stay
    float32)."""

    context_parallel = True  # a short convolution: XLA passes each span its left neighbour's last inputs

    def __init__(self, d_model: int, *, expand: PosInt = 4, kernel_size: PosInt = 3, dtype=jnp.float32, rngs: nnx.Rngs):
        if expand * d_model % 2:
            raise ValueError(f"expand={expand} times d_model={d_model} must be even (u and g split it)")
        if kernel_size < 1:
            raise ValueError(f"kernel_size={kernel_size} must be >= 1")
        self.d_model, self.inner, self.dtype = d_model, expand * d_model // 2, dtype
        self.in_proj = Linear(d_model, 2 * self.inner, dtype=dtype, rngs=rngs, kernel_metadata=axes(*COLUMNS))
        self.out_proj = Linear(self.inner, d_model, dtype=dtype, rngs=rngs, kernel_metadata=axes(*ROWS))
        self.conv = ShortConvolution(self.inner, kernel_size, rngs=rngs)

    def init_state(self, batch_size: int, max_len: int = 0) -> BaseConvState:
        """max_len is ignored: the state has a fixed size."""
        return BaseConvState(conv=self.conv.init_state(batch_size, self.dtype))

    def _mix(self, x, state: BaseConvState, segment_ids, mode, steps: bool):
        """One form (mode unused); steps=True keeps the window after every token, (T, B, W, Di)."""
        u, g = jnp.split(self.in_proj(x.astype(self.dtype)), 2, axis=-1)  # (B, T, Di) each
        u, conv = self.conv.decode(u, state.conv, segment_ids=segment_ids, steps=steps)  # silu(conv(u))
        return self.out_proj(u * g), (BaseConvState.stepped if steps else BaseConvState)(conv=conv)

