"""MoBA, Mixture of Block Attention (Lu et al. 2025): one entry point, implementations chosen by `impl`.

- "reference": reference.py, the masked dense softmax with the blocks chosen from the definition;
- "xla" (and "auto"; no Pallas kernel yet, so "pallas" is refused): xla.py, per query the gathered
  keys of its selected blocks, no (T, S) scores.
"""

from kernels import check_impl
from kernels.moba.reference import moba_gate, moba_reference, select_blocks
from kernels.moba.xla import attend_blocks, moba_xla, pooled_gate, take

__all__ = ["moba", "moba_gate", "moba_reference", "moba_xla", "select_blocks", "attend_blocks", "pooled_gate",
           "take", "check_blocks"]


def check_blocks(block_size, top_k, where: str):
    """Refuse a block_size or top_k that is not a positive int, naming `where`."""
    for name, value in (("block_size", block_size), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name}={value!r}; expected a positive int")


def moba(q, k, v, *, block_size: int, top_k: int, segment_ids=None, scale=None, selected=None, impl="auto"):
    """Causal MoBA of a sequence: q (B, T, H, K), k/v (B, T, G, K|V) with G dividing H -> o (B, T, H, V).
    block_size b: keys per block, counted from each document's start (segment_ids (B, T)); top_k: blocks
    each query head attends to, its own included; scale: of the logits (None: K^-1/2). selected
    (B, T, H, min(top_k - 1, ceil(T / b))): the earlier blocks to attend to (select_blocks; -1 = none),
    None to choose them by the gate. See reference.py."""
    check_impl(impl, "moba")
    check_blocks(block_size, top_k, "moba")
    if impl == "pallas":
        raise ValueError("moba: impl='pallas' has no kernel yet; expected 'auto', 'reference' or 'xla'")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"moba: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    fn = moba_reference if impl == "reference" else moba_xla
    return fn(q, k, v, block_size=block_size, top_k=top_k, segment_ids=segment_ids, scale=scale, selected=selected)
