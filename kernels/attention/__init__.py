"""Softmax attention: one entry point, implementations chosen by `impl`.

- "reference" / "xla": the XLA form in reference.py (materialises the (T, S) scores);
- "pallas": the flash-attention kernels of kernels.pallas_platform(): pallas.py (Triton) on GPU,
  pallas_tpu.py (Mosaic TPU) on TPU; interpret mode on CPU, which is slow and meant for tests;
- "auto": the Pallas kernels on GPU/TPU when kernels.AUTO_PALLAS is set and pallas.supports() the
  call (not decode-sized calls of T <= 16 queries), the XLA reference elsewhere (on CPU the
  reference is the fast form).
"""

from kernels import check_impl, pallas_platform, use_pallas
from kernels.attention.pallas import BlockSizes, default_block_sizes, flash_attention, supports
from kernels.attention.pallas_tpu import flash_attention_tpu
from kernels.attention.reference import attention_reference

__all__ = ["attention", "attention_reference", "flash_attention", "flash_attention_tpu", "BlockSizes",
           "default_block_sizes"]


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
              causal=True, window=None, scale=None, impl="auto"):
    """q (B, T, H, K), k/v (B, S, G, K|V) with G dividing H -> o (B, T, H, V). See reference.py.

    scale multiplies the logits q . k; None means K^-1/2. Positions default to the T queries being the
    last T of the S keys; a query sees key j when causal (p_j <= p_i), inside `window` (p_j > p_i -
    window) and in the same segment (segment_ids for the queries, kv_segment_ids for the keys,
    defaulting to segment_ids). A query that sees no key returns zeros."""
    check_impl(impl, "attention")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    kwargs = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, window=window, scale=scale)
    if use_pallas(impl, supports(q, k, v)):
        kernel = flash_attention_tpu if pallas_platform() == "tpu" else flash_attention
        return kernel(q, k, v, **kwargs)
    return attention_reference(q, k, v, **kwargs)
