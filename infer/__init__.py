"""Generation: prefill + decode under one jit, sampling, and (later) early exit and speculation."""

from infer.generate import generate, generate_text, sample_logits
