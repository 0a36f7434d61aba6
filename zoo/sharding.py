"""A LanguageModel over a device mesh, all of it in one place: the mesh from `train.mesh`, the
NamedShardings of the parameters (from the logical axes each one carries) and of the optimiser state
(from its parameters'), and the placement of batches (rows split over the batch axes, each process
reading only its own rows). The training loop asks for three things (`make_mesh`, `init_state`,
`batch_placer`); zoo/checkpoint.py loads a model onto any mesh with `init_on_mesh` (so infer
decodes on one), and `make_mesh` builds a mesh for whoever asks (train, infer, benchmarks, tests).

Everything runs through JAX's own SPMD machinery: arrays carry a `NamedSharding` over a `Mesh`, the
jitted step is partitioned by XLA (GSPMD) from those shardings and the hints of
`layers.sharding.constrain`, and the result is the same function as on one device.

Each layer names a parameter's logical axes where it makes it (`axes` metadata on the nnx.Param,
layers/sharding.py); `LOGICAL_TO_MESH` there maps the names to mesh axes. A parameter without axes
is replicated, so a new kind trains on any mesh with no edit here. Non-parameter state (MoE's router
bias, Performer features, random-number counters) is small and replicated. An annotation of the
wrong rank is an error naming the parameter; so is a mesh axis that does not divide the dimension
it shards, a mesh whose size is not the device count, or a batch whose rows do not split over it.
"""

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from layers.sharding import LOGICAL_TO_MESH
from zoo.config import Config, MeshConfig
from zoo.model import LanguageModel
from zoo.registry import LAYER_OF

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")  # outermost (slowest links) first
# Split only where the mesh axis divides them, else kept whole: MQA's single key/value head is
# copied to every tensor rank (as Megatron and vLLM do) rather than making tensor parallelism an error.
WHOLE_WHEN_INDIVISIBLE = {"kv_heads"}


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
    ordered data, fsdp, expert, context, tensor: the innermost axis gets the closest devices."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = {a: getattr(cfg, a) for a in MESH_AXES}
    known = math.prod(n for n in sizes.values() if n != -1)
    described = " x ".join(f"{a}={getattr(cfg, a)}" for a in ("data", "fsdp", "tensor", "expert", "context"))
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
    its shards, and the values are those of `build()` on one device. On a mesh of one device it runs
    eagerly: nothing to split, and no compile of the whole initialiser (0.1-0.4 s a model, once per run)."""
    abstract = nnx.eval_shape(build)
    shardings = state_shardings(abstract, mesh)
    split = lambda: nnx.split(build(), nnx.Param, ...)[1:]
    params, rest = jax.device_put(split(), shardings) if mesh.size == 1 else \
        jax.jit(split, out_shardings=shardings)()
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


def init_state(cfg: Config, tx, mesh: Mesh):
    """(graphdef, params, rest, opt_state, shardings) of a new run of `cfg` with optimiser `tx` on
    `mesh`. The model and the optimiser state are made inside jit with the parameters' shardings as
    outputs, so no device ever holds more than its shards; `shardings` = NamedShardings of (params,
    rest, opt_state)."""
    graphdef, params, rest, (param_sh, rest_sh) = init_on_mesh(
        lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), mesh)
    opt_state, opt_sh = init_optimizer(tx, params, param_sh, mesh)
    return graphdef, params, rest, opt_state, (param_sh, rest_sh, opt_sh)


def init_optimizer(tx, params, param_sh, mesh: Mesh) -> tuple:
    """(opt_state, its NamedShardings): `tx`'s state for `params`, each copy of a parameter sharded as it is."""
    opt_sh = shardings_like_params(jax.eval_shape(tx.init, params), param_sh, mesh)
    if mesh.size == 1:  # as init_on_mesh: eagerly
        return jax.device_put(tx.init(params), opt_sh), opt_sh
    return jax.jit(tx.init, out_shardings=opt_sh)(params), opt_sh


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0, time: bool = False) -> NamedSharding:
    """Rows (dimension `axis`) split over the batch axes data, fsdp and expert; with `time`, the next
    dimension (tokens) over the context axis; the rest whole."""
    spec = [None] * ndim
    spec[axis] = tuple(a for a in LOGICAL_TO_MESH["batch"] if mesh.shape[a] > 1) or None
    if time and mesh.shape["context"] > 1:
        spec[axis + 1] = "context"
    return NamedSharding(mesh, PartitionSpec(*spec))


def process_rows(sharding, shape: tuple, axis: int) -> np.ndarray:
    """Indices along `axis` of a global array of `shape` that this process's devices hold under
    `sharding`, ascending: the rows this host reads (all of them with one process)."""
    held = sharding.addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([np.arange(shape[axis])[index[axis]] for index in held]))


def batch_placer(cfg: Config, mesh: Mesh):
    """(train_batch(batches, step), val_batch(batches, i)): global arrays of the step's batch as
    (micro_batches, b, T), and of the i-th validation batch as (B, T), rows split over the batch
    axes, of which this process reads only its own. `batches` is a source of numpy batches with
    `train_batch(step, batch_size, rows=)` and `val_batch(i, batch_size, rows=)` (train/data.py,
    train/tasks.py). With a context axis, each row's tokens are split over it too (a process keeps the
    spans of its devices). ValueError, before any work, if a micro-batch does not split over the mesh,
    or a sequence over the context axis (`check_context`)."""
    t = cfg.train
    k, micro = t.grad_accum, t.batch_size // t.grad_accum
    split = math.prod(mesh.shape[a] for a in LOGICAL_TO_MESH["batch"])
    if micro % split:
        raise ValueError(f"train.batch_size: {t.batch_size} rows (train.grad_accum={k} micro-batches of {micro}) "
                         f"do not split over the batch axes of train.mesh ({describe(mesh)}: data x fsdp x expert "
                         f"= {split} devices); use a micro-batch that is a multiple of {split}")
    check_context(cfg, mesh)
    train_sh, val_sh = batch_sharding(mesh, 3, axis=1, time=True), batch_sharding(mesh, 2, time=True)
    local = process_rows(train_sh, (k, micro, t.seq_len), axis=1)
    rows = (np.arange(k)[:, None] * micro + local).reshape(-1)  # this process's rows of the whole batch
    val_rows = process_rows(val_sh, (t.batch_size, t.seq_len), axis=0)
    span = process_rows(val_sh, (t.batch_size, t.seq_len), axis=1)  # this process's tokens of each row

    def train_batch(batches, step: int) -> dict:
        b = batches.train_batch(step, t.batch_size, rows=rows)
        return {n: jax.make_array_from_process_local_data(train_sh, v.reshape(k, len(local), -1)[..., span],
                                                          (k, micro, t.seq_len)) for n, v in b.items()}

    def val_batch(batches, i: int) -> dict:
        b = batches.val_batch(i, t.batch_size, rows=val_rows)
        return {n: jax.make_array_from_process_local_data(val_sh, v[:, span], (t.batch_size, t.seq_len))
                for n, v in b.items()}

    return train_batch, val_batch


def _without_context(mixer) -> set[str]:
    """The kinds in a mixer config (a parallel mixer's parts included) whose layer has no context-parallel form."""
    parts = getattr(mixer, "mixers", None)  # zoo/parallel.py
    if parts:
        return set().union(*map(_without_context, parts))
    return set() if LAYER_OF[type(mixer)].context_parallel else {mixer.KIND}


def check_context(cfg: Config, mesh: Mesh):
    """Refuse, naming what is wrong, a context axis that cannot split the run's sequences: a seq_len it
    does not divide, or a mixer kind without a context-parallel form (`context_parallel` of its layer)."""
    n = mesh.shape["context"]
    if n == 1:
        return
    if cfg.train.seq_len % n:
        raise ValueError(f"train.seq_len: {cfg.train.seq_len} tokens do not split over train.mesh.context={n}; "
                         f"use a multiple of {n}")
    refused = sorted(set().union(*map(_without_context, cfg.model.mixers())))
    if refused:
        raise ValueError(f"train.mesh.context={n}: mixer kind {', '.join(refused)} has no context-parallel form "
                         f"(docs/context.md lists the kinds that have one); use train.mesh.context=1 or another kind")


def bytes_per_device(tree) -> dict:
    """Device -> bytes of the shards of `tree`'s arrays that it holds (its memory for them)."""
    out = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def describe(mesh: Mesh) -> str:
    """`data=2 fsdp=4 tensor=1 expert=1 context=1`: the mesh as train.mesh writes it."""
    return " ".join(f"{f.name}={mesh.shape[f.name]}" for f in dataclasses.fields(MeshConfig))


def as_numpy(x) -> np.ndarray:
    """The value of a replicated array as numpy, also when other processes hold other copies."""
    return np.asarray(x.addressable_data(0))
