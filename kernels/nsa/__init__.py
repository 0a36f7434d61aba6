"""NSA, Native Sparse Attention (Yuan et al. 2025): one entry point, implementations chosen by `impl`.

- "reference" (and, for now, "xla" and "auto"): reference.py, the three branches as masked dense
  softmaxes over the (T, S) scores, the blocks chosen from the definition. No blocked XLA form or
  Pallas kernel yet ("pallas" is refused); decode (layers/nsa.py) reads only the selected blocks.
"""

from kernels import check_impl
from kernels.nsa.reference import (
    FORCED,
    NSASizes,
    compressed_ends,
    masked_attention,
    nsa_reference,
    nsa_select,
    overlap_in_strides,
    select_blocks,
)

__all__ = ["nsa", "nsa_reference", "nsa_select", "select_blocks", "compressed_ends", "overlap_in_strides",
           "masked_attention", "NSASizes", "FORCED"]


def nsa(q, k, v, k_cmp, v_cmp, gates, sizes: NSASizes, *, segment_ids=None, scale=None, selected=None, impl="auto"):
    """Causal NSA of a sequence: q (B, T, H, K), k/v (B, T, G, K|V) with G dividing H, k_cmp/v_cmp
    (B, T, G, K|V) the compressed key and value of the block ending at each slot, gates (B, T, H, 3)
    -> o (B, T, H, V); sizes: the blocks and the window. selected (B, T, G, num_selected): the
    selection blocks (nsa_select; -1 = none), None to choose them here. See reference.py."""
    check_impl(impl, "nsa")
    if impl == "pallas":
        raise ValueError("nsa: impl='pallas' has no kernel yet; expected 'auto', 'reference' or 'xla'")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"nsa: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    return nsa_reference(q, k, v, k_cmp, v_cmp, gates, sizes, segment_ids=segment_ids, scale=scale, selected=selected)
