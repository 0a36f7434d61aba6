"""Short causal depthwise convolution over time (the `conv1d` of Mamba, H3 and the fla layers).

    y_t = act(sum_{j=0}^{W-1} w_j * x_{t-W+1+j} + b)

`channel_axis` is the logical sharding axis of the channels ("heads" by default; None keeps a conv
over fused quantities whole). Decoding keeps the last kernel_size - 1 inputs as state, (B, W, D), so
it costs the same at any context. A tap never reads across a document boundary: with `segment_ids`,
inputs from an earlier document
count as zeros, exactly as if the document had been run alone.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import context
from kernels.segments import document_starts
from layers.sharding import axes


class ShortConvolution(nnx.Module):
    def __init__(self, dim: int, kernel_size: int = 4, *, activation: bool = True, use_bias: bool = False,
                 channel_axis: str | None = "heads", rngs: nnx.Rngs):
        self.kernel_size = kernel_size
        self.activation = activation
        bound = 1.0 / kernel_size ** 0.5  # PyTorch's Conv1d default (fan_in = W for depthwise)
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, dim), jnp.float32, -bound, bound),
                                **axes(None, channel_axis))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), **axes(channel_axis)) if use_bias else None

    def init_state(self, batch_size: int, dtype=jnp.float32) -> Float[Array, "B W D"]:
        return jnp.zeros((batch_size, self.kernel_size - 1, self.weight.shape[1]), dtype)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        return self.decode(x, self.init_state(x.shape[0], x.dtype), segment_ids=segment_ids)[0]

    def decode(self, x: Float[Array, "B T D"], state: Float[Array, "B W D"], *,
               segment_ids: Int[Array, "B T"] | None = None, steps: bool = False):
        """With `steps` (segment_ids None), the window after every token, (T, B, W, D) (layers/state.py). Over
        a sequence split along time (kernels/context.py) whose spans fill a window, each span runs on its device
        from the window of the span before it."""
        W, T = self.kernel_size, x.shape[1]
        params = (self.weight[...],) + (() if self.bias is None else (self.bias[...],))
        if not steps and W > 1 and context.active(T) and T // context.size() >= W - 1:
            return context.over_spans(self._span, (x,), params, segment_ids, state)
        return self._taps(x, state, *params, segment_ids=segment_ids, steps=steps)

    def _span(self, seq, params, segment_ids, window):
        """One device's span: its window is the last inputs of the span before it (`context.from_left`)."""
        (x,) = seq
        end = self._taps(x, jnp.zeros_like(window), *params, segment_ids=segment_ids)[1]  # its own inputs only
        y, end = self._taps(x, context.from_left(end, window, segment_ids), *params, segment_ids=segment_ids)
        return y, context.last(end)

    def _taps(self, x, state, weight, bias=None, *, segment_ids, steps: bool = False):
        W, T = self.kernel_size, x.shape[1]
        xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # (B, W-1+T, D)
        if segment_ids is not None:
            # Document index of each padded position; the state belongs to the first token's document.
            doc = jnp.cumsum(document_starts(segment_ids), axis=1)  # (B, T)
            doc = jnp.concatenate([jnp.zeros_like(doc[:, :1]).repeat(W - 1, 1), doc], axis=1)
        w = weight.astype(x.dtype)
        y = jnp.zeros(x.shape, jnp.float32)
        for j in range(W):  # W is 2-4: a few shifted multiply-adds beat a generic conv on CPU
            tap = xp[:, j:j + T] * w[j]
            if segment_ids is not None:
                tap = jnp.where((doc[:, j:j + T] == doc[:, W - 1:])[..., None], tap, 0)
            y = y + tap
        if bias is not None:
            y = y + bias
        if self.activation:
            y = jax.nn.silu(y)
        if steps:
            after = jnp.arange(T)[:, None] + 1 + jnp.arange(W - 1)[None]  # (T, W): token t's window in xp
            return y.astype(x.dtype), jnp.swapaxes(xp[:, after], 0, 1).astype(state.dtype)  # (T, B, W, D)
        window = xp[:, T:]
        if segment_ids is not None:  # inputs of a document that ended inside this call are not carried
            window = jnp.where((doc[:, T:] == doc[:, -1:])[..., None], window, 0)
        return y.astype(x.dtype), window.astype(state.dtype)


def init_windows(convs, batch_size: int, dtype) -> tuple:
    """The fresh decode windows of a layer's convolutions, None for a conv that is None (built without)."""
    return tuple(None if c is None else c.init_state(batch_size, dtype) for c in convs)


def convolve(convs, xs, windows, *, segment_ids, steps: bool = False) -> tuple[tuple, tuple]:
    """Each of `xs` through its convolution, continuing its window: (outputs, new windows); where the conv
    is None, the input as it is and no window."""
    out = [(x, None) if c is None else c.decode(x, w, segment_ids=segment_ids, steps=steps)
           for c, x, w in zip(convs, xs, windows)]
    return tuple(y for y, _ in out), tuple(w for _, w in out)
