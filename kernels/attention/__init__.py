"""Softmax attention: one entry point, implementations chosen by `impl`.

Only the reference (XLA) form exists so far; Pallas kernels (flash attention) will register here.
"""

from kernels.attention.reference import attention_reference

IMPLS = ("auto", "reference", "xla")


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
              causal=True, window=None, scale=None, impl="auto"):
    """q (B, T, H, K), k/v (B, S, G, K|V) with G dividing H -> o (B, T, H, V). See reference.py."""
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r}; expected one of {IMPLS}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    return attention_reference(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                               window=window, scale=scale)
