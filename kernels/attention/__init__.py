"""Softmax attention: one entry point, implementations chosen by `impl`.

- "reference": reference.py, the masked softmax written out (the truth the others are tested against);
- "xla": xla.py, the fast XLA forms: dense scores heads first with jax.nn.softmax, or blocked with an
  online softmax and skipped block pairs for long sequences and decode steps against a long cache;
- "pallas": the flash-attention kernels of kernels.pallas_platform(): pallas.py (Triton) on GPU,
  pallas_tpu.py (Mosaic TPU) on TPU; interpret mode on CPU, which is slow and meant for tests;
- "auto": the Pallas kernels on GPU/TPU when kernels.AUTO_PALLAS is set and pallas.supports() the
  call (not decode-sized calls of T <= 16 queries), the XLA forms elsewhere.
"""

from kernels import check_impl, pallas_platform, use_pallas
from kernels.attention.pallas import BlockSizes, default_block_sizes, flash_attention, supports
from kernels.attention.pallas_tpu import flash_attention_tpu
from kernels.attention.reference import attention_reference
from kernels.attention.xla import attention_xla

__all__ = ["attention", "attention_reference", "attention_xla", "flash_attention", "flash_attention_tpu",
           "BlockSizes", "default_block_sizes"]


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
              causal=True, window=None, scale=None, impl="auto", kv_heads_first=False):
    """q (B, T, H, K), k/v (B, S, G, K|V) with G dividing H -> o (B, T, H, V). See reference.py.
    With kv_heads_first, k/v are (B, G, S, K|V), a KV cache's layout (the XLA forms read it as is).

    scale multiplies the logits q . k; None means K^-1/2. Positions default to the T queries being the
    last T of the S keys; a query sees key j when causal (p_j <= p_i), inside `window` (p_j > p_i -
    window) and in the same segment (segment_ids for the queries, kv_segment_ids for the keys,
    defaulting to segment_ids). A query that sees no key returns zeros."""
    check_impl(impl, "attention")
    G = k.shape[1 if kv_heads_first else 2]
    if q.shape[2] % G:
        raise ValueError(f"attention: {G} kv heads do not divide {q.shape[2]} query heads")
    kwargs = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, causal=causal, window=window, scale=scale)
    ks, vs = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if kv_heads_first else (k, v)  # (B, S, G, K)
    if use_pallas(impl, supports(q, ks, vs)):  # (an unused transpose costs nothing: XLA drops it)
        kernel = flash_attention_tpu if pallas_platform() == "tpu" else flash_attention
        return kernel(q, ks, vs, **kwargs)
    if impl == "reference":
        return attention_reference(q, ks, vs, **kwargs)
    return attention_xla(q, k, v, **kwargs, kv_heads_first=kv_heads_first)
