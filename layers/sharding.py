"""Logical axis names and the one table that maps them to device-mesh axes.

Parameters and activations are described with logical names (what a dimension *is*) and the table
below says which mesh axes split it, as in MaxText and T5X:

    batch    -> data, fsdp, expert   rows of a batch: every axis but tensor and context splits them
    length   -> context              time of a (B, T, ...) activation: one sequence over devices
    embed    -> fsdp                 the model width of a weight: FSDP (ZeRO-3) shards it
    heads    -> tensor               attention/mixer heads and inner channels (Megatron columns)
    kv_heads -> tensor               key/value heads of grouped-query attention (whole if fewer)
    mlp      -> tensor               the FFN hidden width
    vocab    -> tensor               the vocabulary of the embedding and the logits
    expert   -> expert               MoE experts
    None     -> (replicated)

Every layer writes a parameter's logical axes where it makes the parameter, as metadata on the
`nnx.Param`: `nnx.Param(value, axes=("embed", "heads"))`, or `kernel_metadata=axes(*COLUMNS)` on an
`nnx.Linear`. A parameter without `axes` is replicated, so a new layer trains on any mesh unedited
(and shards once it names its axes). The key is `axes`, not flax's `out_sharding`: flax shards a
variable with `out_sharding` eagerly when it is made, which needs a mesh in context and mesh-axis
names, whereas these are logical names that `LOGICAL_TO_MESH` maps when the mesh is known
(zoo/sharding.py, which also holds the mesh's axes and the placement of batches). This file holds
only what a layer needs to declare its axes. The scheme is Megatron's for `tensor` (projections into
heads split by columns, out of heads by rows, so each block needs one all-reduce) and ZeRO-3's for
`fsdp` (every weight sharded over the model width and gathered when used).

`constrain` is the activation hint layers use; it is a no-op without a multi-device mesh in
context (`jax.set_mesh`), so single-device code traces exactly as before.
"""

import jax
from jax.sharding import PartitionSpec

LOGICAL_TO_MESH = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "expert": ("expert",),
}
COLUMNS, ROWS = ("embed", "heads"), ("heads", "embed")  # (D, H*K) into heads, (H*V, D) out of heads


def axes(*names) -> dict:
    """Variable metadata naming one logical axis (or None) per dimension: `kernel_metadata=axes(...)`."""
    return {"axes": names}


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
    """`jax.lax.with_sharding_constraint` of x by logical `axes` (one name or None per dimension),
    against the mesh in context. A hint, not a requirement: a mesh axis that does not divide its
    dimension (a batch of one row while decoding) is left out, and without a mesh nothing happens."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = []
    for dim, name in zip(x.shape, axes, strict=True):
        kept, size = [], 1
        for a in LOGICAL_TO_MESH[name] if name else ():
            if a in mesh.axis_names and dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        spec.append(tuple(kept) or None)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
