"""Causal depthwise long convolution: a filter as long as the sequence, one per channel, the core of
S4D's convolution mode (kernels/s4d) and of Hyena's long convolutions (layers/hyena.py):

    y[b, t, d] = sum_{s <= t} k[t - s, d] u[b, s, d]

impl: "reference" the masked dense Toeplitz product (reference.py, O(T^2 D)); "xla" and "auto" the
FFT form (fft.py, O(T log T) per channel), except with `segment_ids`, where they run the masked form
too: a convolution by FFT mixes every earlier token in, and the exact way to keep documents apart is
to zero the filter's taps across a document start, i.e. the block-diagonal mask of reference.py
(O(T^2 D) in time and memory: packed training pays it). There is no Pallas kernel: impl="pallas" is refused.
"""

from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.long_conv.fft import long_conv_fft
from kernels.long_conv.reference import long_conv_reference


def long_conv(u: Float[Array, "B T D"], k: Float[Array, "T D"], *, segment_ids: Int[Array, "B T"] | None = None,
              impl: str = "auto") -> Float[Array, "B T D"]:
    """y (B, T, D) float32: u convolved causally with the filter k (its taps at lags 0..T-1), within
    each document when segment_ids (B, T) is given."""
    check_no_pallas(impl, "long_conv")
    if u.shape[1:] != k.shape:
        raise ValueError(f"long_conv: expected u (B, T, D) and k (T, D); got u {u.shape}, k {k.shape}")
    if impl == "reference" or segment_ids is not None:
        return long_conv_reference(u, k, segment_ids)
    return long_conv_fft(u, k)


__all__ = ["long_conv", "check_no_pallas"]
