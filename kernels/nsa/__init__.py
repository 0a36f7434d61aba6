"""NSA, Native Sparse Attention (Yuan et al. 2025): one entry point, implementations chosen by `impl`.

- "reference" (and, for now, "xla" and "auto"): reference.py, the three branches as masked dense
  softmaxes over the (T, S) scores, the blocks chosen from the definition. No blocked XLA form or
  Pallas kernel yet ("pallas" is refused); decode (layers/nsa.py) reads only the selected blocks.
"""

from kernels import check_impl
from kernels.nsa.reference import (
    FORCED,
    compressed_ends,
    masked_attention,
    nsa_reference,
    nsa_select,
    overlap_in_strides,
    select_blocks,
)

__all__ = ["nsa", "nsa_reference", "nsa_select", "select_blocks", "compressed_ends", "overlap_in_strides",
           "check_nsa", "masked_attention", "FORCED"]


def check_nsa(block_len, stride, select_len, num_selected, window, where: str):
    """Refuse sizes NSA cannot run, naming `where`: positive ints, stride dividing block_len and
    select_len (eq. 9's blocking), at least the FORCED always-selected blocks."""
    sizes = dict(block_len=block_len, stride=stride, select_len=select_len, num_selected=num_selected, window=window)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name}={value!r}; expected a positive int")
    if block_len % stride or select_len % stride:
        raise ValueError(f"{where}: stride={stride} must divide block_len={block_len} and select_len={select_len}")
    if num_selected < FORCED:
        raise ValueError(f"{where}: num_selected={num_selected}; expected at least {FORCED} (the initial block and "
                         "the two local blocks are always selected)")


def nsa(q, k, v, k_cmp, v_cmp, gates, *, block_len: int, stride: int, select_len: int, num_selected: int,
        window: int, segment_ids=None, scale=None, selected=None, impl="auto"):
    """Causal NSA of a sequence: q (B, T, H, K), k/v (B, T, G, K|V) with G dividing H, k_cmp/v_cmp
    (B, T, G, K|V) the compressed key and value of the block ending at each slot, gates (B, T, H, 3)
    -> o (B, T, H, V). selected (B, T, G, num_selected): the selection blocks (nsa_select; -1 = none),
    None to choose them here. See reference.py."""
    check_impl(impl, "nsa")
    check_nsa(block_len, stride, select_len, num_selected, window, "nsa")
    if impl == "pallas":
        raise ValueError("nsa: impl='pallas' has no kernel yet; expected 'auto', 'reference' or 'xla'")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"nsa: {k.shape[2]} kv heads do not divide {q.shape[2]} query heads")
    return nsa_reference(q, k, v, k_cmp, v_cmp, gates, block_len=block_len, stride=stride, select_len=select_len,
                         num_selected=num_selected, window=window, segment_ids=segment_ids, scale=scale,
                         selected=selected)
