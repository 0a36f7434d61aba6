"""A LanguageModel over a device mesh: the mesh from `train.mesh`, the rule table that gives every
parameter logical axis names, and the NamedShardings that follow from them.

Everything runs through JAX's own SPMD machinery: arrays carry a `NamedSharding` over a `Mesh`, the
jitted step is partitioned by XLA (GSPMD) from those shardings and the hints of
`layers.sharding.constrain`, and the result is the same function as on one device.

The rule table is keyed by layer class. Each entry maps a parameter's path inside that layer (a
glob: `[qkv]_proj/kernel`) to one logical name per dimension, or to REPLICATED for any rank. The
logical names map to mesh axes in `layers.sharding.LOGICAL_TO_MESH`, the one other table. A layer's
rules apply to its subclasses; a parent's rule wins over its child's (Mamba-2 keeps its fused
convolution whole). The scheme is Megatron's for `tensor` (projections into heads split by
columns, out of heads by rows, so each block needs one all-reduce) and ZeRO-3's for `fsdp` (every
weight sharded over the model width and gathered when used). Projections whose output fuses several
quantities ([x, z] in Mamba, [x, z, B, C, dt] in Mamba-2) are not split over `tensor`: a column
split would cut between the quantities, not within each. Non-parameter state (MoE's router bias,
Performer features, random-number counters) is small and replicated.

A parameter no rule covers is an error naming its path; so is a mesh axis that does not divide the
dimension it shards, or a mesh whose size is not the device count.
"""

import dataclasses
import fnmatch
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import layers
from layers.sharding import LOGICAL_TO_MESH, MESH_AXES, WHOLE_WHEN_INDIVISIBLE
from zoo.config import MeshConfig
from zoo.model import LanguageModel

REPLICATED = ()  # any rank, every dimension whole on every device
COLUMNS, ROWS = ("embed", "heads"), ("heads", "embed")  # into heads / out of heads (Megatron)
DELTA_RULE = [("[qkvg]_proj/kernel", COLUMNS), ("o_proj/kernel", ROWS), ("[ab]_proj/kernel", ("embed", None)),
              ("A_log", REPLICATED), ("dt_bias", REPLICATED)]  # DeltaNet and Gated DeltaNet
RULES: dict[type, list[tuple[str, tuple]]] = {
    LanguageModel: [("embed/embedding", ("vocab", "embed")), ("head", ("embed", "vocab")),
                    ("exit_heads", (None, "embed", "vocab")), ("exit_classifier", REPLICATED)],
    layers.RMSNorm: [("weight", REPLICATED)],
    layers.ShortConvolution: [("weight", (None, "heads")), ("bias", ("heads",))],
    layers.MLP: [("w_gate", ("embed", "mlp")), ("w_up", ("embed", "mlp")), ("w_down", ("mlp", "embed"))],
    layers.MoE: [("w_router", ("embed", None)), ("w_gate", ("expert", "embed", "mlp")),
                 ("w_up", ("expert", "embed", "mlp")), ("w_down", ("expert", "mlp", "embed"))],
    layers.Attention: [("wq", ("embed", "heads", None)), ("w[kv]", ("embed", "kv_heads", None)),
                       ("wo", ("heads", None, "embed"))],
    layers.LinearAttention: [("[qkv]_proj/kernel", COLUMNS), ("o_proj/kernel", ROWS),
                             ("hedgehog_[qk]", ("heads", None, None)), ("hedgehog_[qk]_bias", ("heads", None))],
    layers.MultiScaleRetention: [("[qkvg]_proj/kernel", COLUMNS), ("o_proj/kernel", ROWS)],
    layers.GatedLinearAttention: [("[qkvg]_proj/kernel", COLUMNS), ("o_proj/kernel", ROWS),
                                  ("gk_down/kernel", ("embed", None)), ("gk_up/kernel", (None, "heads")),
                                  ("gk_up/bias", ("heads",))],
    layers.DeltaNet: DELTA_RULE,
    layers.GatedDeltaNet: DELTA_RULE,
    layers.Mamba: [("in_proj/kernel", ("embed", None)), ("x_proj/kernel", ("heads", None)),
                   ("dt_proj/kernel", (None, "heads")), ("dt_bias", ("heads",)), ("A_log", ("heads", None)),
                   ("D", ("heads",)), ("out_proj/kernel", ROWS)],
    layers.Mamba2: [("in_proj/kernel", ("embed", None)), ("conv/*", REPLICATED), ("dt_bias", REPLICATED),
                    ("A_log", REPLICATED), ("D", REPLICATED), ("out_proj/kernel", ROWS)],
    layers.RWKV6TimeMix: [("w_[rkvg]", COLUMNS), ("w_o", ROWS), ("mix_a", ("embed", None)),
                          ("mix_b", (None, None, "embed")), ("decay_a", ("embed", None)), ("decay_b", (None, "embed")),
                          ("mu*", REPLICATED), ("decay_base", REPLICATED), ("bonus", REPLICATED),
                          ("ln_*", REPLICATED)],
    layers.RWKV7TimeMix: [("w_[rkv]", COLUMNS), ("w_o", ROWS), ("*_a", ("embed", None)), ("*_b", (None, "embed")),
                          ("mu", REPLICATED), ("*_base", REPLICATED), ("removal_scale", REPLICATED),
                          ("replace_rate", REPLICATED), ("bonus", REPLICATED), ("ln_*", REPLICATED)],
    layers.RWKV6ChannelMix: [("w_k", ("embed", "mlp")), ("w_r", ("embed", None)), ("w_v", ("mlp", "embed")),
                             ("mu_*", REPLICATED)],
    layers.RWKV7ChannelMix: [("w_k", ("embed", "mlp")), ("w_v", ("mlp", "embed")), ("mu_k", REPLICATED)],
}


def _rules_of(module) -> list:
    """The rules of a module's class and of its base classes, the most specific first."""
    return [r for cls in type(module).__mro__ for r in RULES.get(cls, [])]


def logical_axes(model: nnx.Module) -> dict[tuple, tuple]:
    """Parameter path -> one logical axis name (or None) per dimension, for every nnx.Param."""
    modules = dict(nnx.iter_modules(model))
    out = {}
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for i in range(len(path)):  # the outermost layer with a matching rule decides
            inner = "/".join(map(str, path[i:]))
            axes = next((a for pattern, a in _rules_of(modules.get(path[:i])) if fnmatch.fnmatchcase(inner, pattern)),
                        None)
            if axes is not None:
                break
        else:
            owners = " > ".join(type(modules[path[:i]]).__name__ for i in range(len(path)) if path[:i] in modules)
            raise ValueError(f"parameter {'/'.join(map(str, path))} (shape {tuple(param.shape)}, in {owners}) has "
                             "no sharding rule; add one for its layer to RULES in zoo/sharding.py")
        axes = axes or (None,) * len(param.shape)
        if len(axes) != len(param.shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))}: its rule names {len(axes)} axes {axes} "
                             f"for shape {tuple(param.shape)}")
        out[path] = axes
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


def state_shardings(model: nnx.Module, mesh: Mesh) -> tuple[nnx.State, nnx.State]:
    """NamedShardings shaped like `nnx.split(model, nnx.Param, ...)[1:]`: the parameters by the
    rules, the rest replicated. `model` may be abstract (nnx.eval_shape)."""
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
    made inside one jit whose outputs carry the rules' shardings: no device ever holds more than
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
