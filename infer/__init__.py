"""Generation: prefill + decode under one jit, sampling, early exit, speculation and quantized decoding."""

from infer.generate import generate, generate_text, sample_logits
from infer.quantize import quantize
