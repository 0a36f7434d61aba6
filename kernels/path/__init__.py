"""PaTH attention (Yang et al., 2025, arXiv:2505.16381): softmax attention whose position signal is a product of
data-dependent generalised Householder matrices, one per token. One entry point for training, one for decoding
from a cache of transformed keys, the form picked by `impl`.

    H_t  = I - β_t w_t w_t^T                              |w_t| = 1, β_t in (0, 2): eigenvalues 1 and 1 - β_t
    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j              j <= i of i's document (no factor for j = i)
    o_i  = Σ_j softmax_j(scale * (s_ij + c_i - c_j)) v_j

c (`decay`, optional) is the cumulative log forget gate of FoX (B, T, H), and, as in flash-linear-attention's
kernels, its difference is multiplied by `scale` with the logit. G kv heads serve H / G query heads (GQA): k,
w and β are per kv head, q and the gate per query head. Packed documents (`segment_ids`, contiguous runs as in
kernels/segments.py): a query sees only keys of its own document and the product runs only over its factors.

- "reference": reference.py, one query at a time walking back over the keys (decode: the paper's token by
  token cache update k_j <- H_t k_j);
- "xla" / "auto": dense.py, blocks of `chunk_size` tokens against a cache of the keys carried to each block's
  start (the UT form of the product inside a block), one lax.scan over blocks.
There is no Pallas kernel (impl="pallas" is refused): fla's Triton kernels are flash-style (online softmax over
key blocks, the product kept as low-rank block factors); here a block's logits against all keys are dense.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.path.dense import path_blocks
from kernels.path.reference import path_decode_reference, path_reference
from kernels.segments import document_index

# One compiled program per shape when called eagerly (a notebook, a docs example): op by op, the block form's
# few hundred small ops each compiled on its own took 3x as long. Under an outer jit it is inlined.
_blocks = jax.jit(path_blocks, static_argnames=("scale", "chunk_size"))

__all__ = ["PathSlots", "empty_slots", "path_attention", "path_attention_cached", "path_blocks",
           "path_decode_reference", "path_reference"]


class PathSlots(NamedTuple):
    """A PaTH KV cache's slots: each key carried through the factors of its document's later tokens."""
    k: Float[Array, "B G S K"]  # (B, G, S, K) transformed keys, heads first
    v: Float[Array, "B G S V"]  # (B, G, S, V)
    doc: Int[Array, "B S"]  # (B, S) int32 document number of each slot's token, -1 for none
    decay: Float[Array, "B H S"] | None = None  # (B, H, S) c of each slot's token, with a forget gate


def empty_slots(B: int, G: int, S: int, K: int, V: int, H: int | None = None, dtype=jnp.float32) -> PathSlots:
    """S empty slots; H given (the query heads), with a forget gate's c."""
    return PathSlots(jnp.zeros((B, G, S, K), dtype), jnp.zeros((B, G, S, V), dtype),
                     jnp.full((B, S), -1, jnp.int32), None if H is None else jnp.zeros((B, H, S), jnp.float32))


def _check(q, k, v, w, beta, decay, where):
    B, T, H, K = q.shape
    G = k.shape[2]
    if H % G:
        raise ValueError(f"{where}: {G} kv heads do not divide {H} query heads")
    want = {"k": (B, T, G, K), "v": (B, T, G, v.shape[-1]), "w": (B, T, G, K), "beta": (B, T, G)}
    if decay is not None:
        want["decay"] = (B, T, H)
    for name, shape in want.items():
        got = {"k": k, "v": v, "w": w, "beta": beta, "decay": decay}[name].shape
        if got != shape:
            raise ValueError(f"{where}: {name} of shape {got}; expected {shape}")


def path_attention(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                   w: Float[Array, "B T G K"], beta: Float[Array, "B T G"], *,
                   decay: Float[Array, "B T H"] | None = None, segment_ids: Int[Array, "B T"] | None = None,
                   scale: float | None = None, impl: str = "auto", chunk_size: int = 64) -> Float[Array, "B T H V"]:
    """o (B, T, H, V) in q's dtype. w: unit vectors; beta: β in (0, 2); scale None means K^-1/2."""
    check_no_pallas(impl, "path_attention")
    _check(q, k, v, w, beta, decay, "path_attention")
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    doc = document_index(segment_ids, B, T)  # (B, T): segment ids as runs, numbered from 0
    if impl == "reference":
        return path_reference(q, k, v, w, beta, doc, decay, scale).astype(q.dtype)
    slots = empty_slots(B, k.shape[2], T, K, v.shape[-1], None if decay is None else H)
    o, _ = _blocks(q, k, v, w, beta, doc, decay, slots, jnp.zeros((B,), jnp.int32), scale, chunk_size)
    return o.astype(q.dtype)


def path_attention_cached(q: Float[Array, "B T H K"], k: Float[Array, "B T G K"], v: Float[Array, "B T G V"],
                          w: Float[Array, "B T G K"], beta: Float[Array, "B T G"], slots: PathSlots,
                          index: Int[Array, " B"], *, doc: Int[Array, "B T"],
                          decay: Float[Array, "B T H"] | None = None, scale: float | None = None,
                          impl: str = "auto", chunk_size: int = 64
                          ) -> tuple[Float[Array, "B T H V"], PathSlots]:
    """The T tokens after each row's `index` (B,) cached tokens, written at slots index..index+T-1: (o (B, T, H, V)
    in q's dtype, the slots after). doc (B, T): the tokens' document numbers, in the numbering of slots.doc (a
    query sees a slot before its own of its document; a token's factor carries the slots of its document)."""
    check_no_pallas(impl, "path_attention_cached")
    _check(q, k, v, w, beta, decay, "path_attention_cached")
    if (decay is None) != (slots.decay is None):
        raise ValueError("path_attention_cached: give decay with slots.decay (a forget gate), or neither")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if impl == "reference":
        o, slots = path_decode_reference(q, k, v, w, beta, doc, decay, slots, index, scale)
    else:
        o, slots = _blocks(q, k, v, w, beta, doc, decay, slots, index, scale, chunk_size)
    return o.astype(q.dtype), slots
