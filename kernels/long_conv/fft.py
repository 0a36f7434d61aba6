"""Causal depthwise long convolution by FFT (the convolution theorem): O(T log T) per channel.

Both sequences are zero-padded to 2T, so the circular convolution of the transforms equals the linear
one on the first T outputs (the wrap-around lands at t >= T). Packed documents cannot be separated
this way (the filter does not know where a document starts): the op runs the masked form for them.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float


def long_conv_fft(u: Float[Array, "B T D"], k: Float[Array, "T D"]) -> Float[Array, "B T D"]:
    T = u.shape[1]
    u_f = jnp.fft.rfft(u.astype(jnp.float32), n=2 * T, axis=1)  # (B, T + 1, D) complex
    k_f = jnp.fft.rfft(k.astype(jnp.float32), n=2 * T, axis=0)  # (T + 1, D)
    return jnp.fft.irfft(u_f * k_f, n=2 * T, axis=1)[:, :T]  # (B, T, D)
