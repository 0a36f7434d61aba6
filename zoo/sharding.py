"""A LanguageModel over a device mesh: the mesh from `train.mesh`, the logical axes every parameter
carries, and the NamedShardings that follow from them.

Everything runs through JAX's own SPMD machinery: arrays carry a `NamedSharding` over a `Mesh`, the
jitted step is partitioned by XLA (GSPMD) from those shardings and the hints of
`layers.sharding.constrain`, and the result is the same function as on one device.

Each layer names a parameter's logical axes where it makes it (`axes` metadata on the nnx.Param,
layers/sharding.py); `LOGICAL_TO_MESH` there maps the names to mesh axes. A parameter without axes
is replicated, so a new kind trains on any mesh with no edit here. Non-parameter state (MoE's router
bias, Performer features, random-number counters) is small and replicated. An annotation of the
wrong rank is an error naming the parameter; so is a mesh axis that does not divide the dimension
it shards, or a mesh whose size is not the device count.
"""

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from layers.sharding import LOGICAL_TO_MESH, MESH_AXES, WHOLE_WHEN_INDIVISIBLE
from zoo.config import MeshConfig


def logical_axes(model: nnx.Module) -> dict[tuple, tuple]:
    """Parameter path -> one logical axis name (or None) per dimension, for every nnx.Param: its
    `axes` metadata, or all None (replicated) where the layer gives none."""
    out = {}
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = param.get_metadata().get("axes")
        names = (None,) * len(param.shape) if names is None else tuple(names)
        if len(names) != len(param.shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))}: its axes {names} name {len(names)} "
                             f"dimensions of shape {tuple(param.shape)}")
        unknown = [n for n in names if n is not None and n not in LOGICAL_TO_MESH]
        if unknown:
            raise ValueError(f"parameter {'/'.join(map(str, path))}: unknown logical axes {unknown}; expected "
                             f"names from layers.sharding.LOGICAL_TO_MESH ({', '.join(LOGICAL_TO_MESH)})")
        out[path] = names
    return out


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The device mesh of `train.mesh` over `devices` (default: every device of every process), axes
    ordered data, fsdp, expert, tensor: the innermost axis gets the closest devices."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = {a: getattr(cfg, a) for a in MESH_AXES}
    known = math.prod(n for n in sizes.values() if n != -1)
    described = " x ".join(f"{a}={getattr(cfg, a)}" for a in ("data", "fsdp", "tensor", "expert"))
    for axis, n in sizes.items():
        if n == -1:
            if len(devices) % known:
                raise ValueError(f"train.mesh: {described} cannot fill {len(devices)} devices: the fixed axes "
                                 f"({known} devices) do not divide {len(devices)}")
            sizes[axis] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"train.mesh: {described} is {math.prod(sizes.values())} devices, but there are "
                         f"{len(devices)} ({devices[0].platform}); the product must equal the device count "
                         "(set one axis to -1 for the rest)")
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def partition_spec(name: str, shape: tuple, axes: tuple, mesh) -> PartitionSpec:
    """PartitionSpec of an array with logical `axes` on `mesh` (a Mesh or AbstractMesh); mesh axes of
    size 1 are dropped. ValueError if a mesh axis does not divide its dimension (except the names in
    WHOLE_WHEN_INDIVISIBLE, which then stay whole)."""
    spec = []
    for dim, (n, logical) in enumerate(zip(shape, axes, strict=True)):
        used = tuple(a for a in (LOGICAL_TO_MESH[logical] if logical else ()) if mesh.shape[a] > 1)
        if n % math.prod(mesh.shape[a] for a in used) and logical in WHOLE_WHEN_INDIVISIBLE:
            used = ()
        if n % math.prod(mesh.shape[a] for a in used):
            sizes = " x ".join(f"train.mesh.{a}={mesh.shape[a]}" for a in used)
            raise ValueError(f"{sizes} does not divide dimension {dim} ({logical}, size {n}) of {name} "
                             f"(shape {tuple(shape)}); choose mesh sizes that divide it")
        spec.append(used[0] if len(used) == 1 else used or None)
    return PartitionSpec(*spec)


def state_shardings(model: nnx.Module, mesh: Mesh):
    """(parameter shardings, rest shardings): two nnx.States of NamedShardings shaped like
    `nnx.split(model, nnx.Param, ...)[1:]`, the parameters by their logical axes, the rest
    replicated. `model` may be abstract (nnx.eval_shape)."""
    axes = logical_axes(model)
    _, params, rest = nnx.split(model, nnx.Param, ...)

    def param_sharding(key_path, x):
        path = tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))
        return NamedSharding(mesh, partition_spec(f"parameter {'/'.join(map(str, path))}", x.shape, axes[path], mesh))

    replicated = NamedSharding(mesh, PartitionSpec())
    return (jax.tree_util.tree_map_with_path(param_sharding, params),
            jax.tree.map(lambda _: replicated, rest))


def init_on_mesh(build, mesh: Mesh):
    """(graphdef, params, rest, (param shardings, rest shardings)) of the module `build()` makes,
    made inside one jit whose outputs carry the parameters' shardings: no device ever holds more than
    its shards, and the values are those of `build()` on one device."""
    abstract = nnx.eval_shape(build)
    shardings = state_shardings(abstract, mesh)
    params, rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:], out_shardings=shardings)()
    return nnx.graphdef(abstract), params, rest, shardings


def shardings_like_params(tree, param_shardings, mesh: Mesh):
    """Shardings for a pytree that holds copies of the parameter tree (an optax state: Adam's mu and
    nu): a leaf whose key path ends with a parameter's gets that parameter's sharding; every other
    leaf (step counts, scalars) is replicated."""
    by_path = {tuple(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(key_path, _):
        return next((by_path[tuple(key_path[i:])] for i in range(len(key_path)) if tuple(key_path[i:]) in by_path),
                    replicated)

    return jax.tree_util.tree_map_with_path(pick, tree)


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Rows (dimension `axis`) split over the batch axes data, fsdp and expert; the rest whole."""
    spec = [None] * ndim
    spec[axis] = tuple(a for a in LOGICAL_TO_MESH["batch"] if mesh.shape[a] > 1) or None
    return NamedSharding(mesh, PartitionSpec(*spec))


def bytes_per_device(tree) -> dict:
    """Device -> bytes of the shards of `tree`'s arrays that it holds (its memory for them)."""
    out = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def describe(mesh: Mesh) -> str:
    """`data=2 fsdp=4 tensor=1 expert=1`: the mesh as train.mesh writes it."""
    return " ".join(f"{f.name}={mesh.shape[f.name]}" for f in dataclasses.fields(MeshConfig))


def as_numpy(x) -> np.ndarray:
    """The value of a replicated array as numpy, also when other processes hold other copies."""
    return np.asarray(x.addressable_data(0))
