"""Generation: prefill + decode under one jit, sampling, stop strings, early exit, speculation and quantized
decoding."""

from infer.factorize import factorize
from infer.generate import Exits, Quantization, Sampling, Speculation, generate, generate_text, sample_logits
from infer.prune import prune, shrink
from infer.quantize import quantize
