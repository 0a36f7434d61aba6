"""Generation: prefill + decode under one jit, sampling, stop strings, early exit, speculation and quantized
decoding; serving a stream of requests (infer/engine.py; its HTTP endpoint: python -m infer.serve)."""

from infer.engine import Engine, Event, Request
from infer.factorize import factorize
from infer.generate import Exits, Quantization, Sampling, Speculation, generate, generate_text, sample_logits
from infer.prune import prune, shrink
from infer.quantize import quantize
