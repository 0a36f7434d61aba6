"""Matrix products the way XLA on CPU differentiates fastest: the leading dimensions of the input
flattened into one, so every projection is one 2-D product.

A `dot_general` of a (B, T, D) input with a (D, H, K) weight computes the same numbers, but on CPU
its backward is much slower: B=8, T=256, D=128, H=4, K=32, an attention block's forward+backward
took 28.7 ms with 3-D operands and 18.8 ms with these, a SwiGLU MLP's 12.1 and 7.4 ms
(benchmarks/peers.py measures the whole model).

A weight may also be held in another form (`HELD`: quantized, layers/quant.py; an adapter, layers/lora.py;
factored, layers/factor.py; input-scaled, layers/smooth.py; recording its inputs, layers/gptq.py; rounding
its inputs in quantization-aware training, layers/quant.py): the product is then its own matmul.
"""

import jax
from flax import nnx

from layers.factor import Factored
from layers.gptq import Recorded
from layers.lora import LowRank
from layers.quant import Int8Rows, Quantized
from layers.smooth import Scaled

HELD = (Quantized, LowRank, Recorded, Factored, Scaled, Int8Rows)  # weights that multiply by their own matmul


def project(x: jax.Array, w: jax.Array | Quantized | LowRank | Recorded | Factored | Scaled | Int8Rows,
            **dot_kwargs) -> jax.Array:
    """x (..., D) @ w (D, *out) -> (..., *out), as one (N, D) @ (D, prod(out)) product."""
    lead, out = x.shape[:-1], w.shape[1:]
    x2, w2 = x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1)
    y = w2.matmul(x2, **dot_kwargs) if isinstance(w2, HELD) else jax.lax.dot(x2, w2, **dot_kwargs)
    return y.reshape(*lead, *out)


class Linear(nnx.Linear):
    """nnx.Linear over flattened leading dimensions (the same parameters and function)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        x2 = x.reshape(-1, x.shape[-1])
        kernel = self.kernel[...]
        if isinstance(kernel, HELD):  # a quantized or adapted kernel: its own matmul (nnx.Linear's is float)
            dtype = self.dtype or x.dtype
            y = project(x2.astype(dtype), kernel.astype(dtype))
            y = y if self.bias is None else y + self.bias[...].astype(dtype)
        else:
            y = super().__call__(x2)
        return y.reshape(*x.shape[:-1], -1)
