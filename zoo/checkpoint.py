"""Orbax checkpoints of a run: `runs/<name>/checkpoints/<step>/{params,rest,opt_state,meta}`.

Sharded arrays are written shard by shard (each process its own) and read back into whatever
shardings the restore targets carry, so a checkpoint moves between meshes and onto one device.

What makes a checkpoint trustworthy, and what happens when one is not:
- Orbax writes each step into a temporary folder and renames it when complete, so a process killed
  mid-write leaves no folder that looks finished.
- After a save, `zoo_checksums.json` in the step folder records the size and SHA-256 of every file.
  A step whose files do not match (truncated, deleted, a flipped bit) is refused by name, moved
  aside to `checkpoints.unreadable/` (kept, never deleted) and the next older step is used. A step
  without the file (its run was killed between the write and the sum) is used if it restores.
- `meta` holds the resolved config of the run that wrote the step, so a resume compares against the
  config the checkpoint belongs to (train/loop.py), whatever happened to config.yaml.
- A verified step that does not fit the restore targets is not a corrupt one: the config differs
  from the checkpoint's, and that is an error naming the difference, never a reason to skip or
  delete anything.
- Old steps are deleted only by `prune`, which keeps the newest `keep` steps.

A run with train.lora keeps each adapted weight's base in `params` and its adapters in `adapters` (a
list of {a, b}; meta's `adapters` says where each belongs): `split_adapters` writes that layout,
`load_model` folds it back into plain weights.
"""

import hashlib
import json
import math
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from layers.lora import LowRank
from zoo.config import from_dict
from zoo.model import LanguageModel
from zoo.run_file import load_config
from zoo.sharding import init_on_mesh

CHECKSUMS = "zoo_checksums.json"


class Unreadable(Exception):
    """A checkpoint step that fails its checksums or cannot be read at all."""


def manager(directory: Path, create: bool = True) -> ocp.CheckpointManager:
    """Synchronous saves (the checksums are taken once a step is complete); no automatic deletion."""
    options = ocp.CheckpointManagerOptions(max_to_keep=None, create=create, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _files(step_dir: Path) -> dict[str, list]:
    out = {}
    for f in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS):
        out[str(f.relative_to(step_dir))] = [f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()]
    return out


def save(mngr: ocp.CheckpointManager, step: int, items: dict, meta: dict):
    """Write `items` (name -> pytree) and `meta` (JSON) as `step`, then its checksums (process 0)."""
    args = {k: ocp.args.StandardSave(v) for k, v in items.items()}
    mngr.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)), force=True)
    mngr.wait_until_finished()
    if jax.process_index() == 0:
        step_dir = Path(mngr.directory) / str(step)
        tmp = step_dir / f"{CHECKSUMS}.tmp"
        tmp.write_text(json.dumps(_files(step_dir)))
        tmp.replace(step_dir / CHECKSUMS)


def verify(step_dir: Path) -> bool:
    """True if the step's files match its checksums, False if it has none; Unreadable names the first
    file that does not match."""
    path = step_dir / CHECKSUMS
    if not path.exists():
        return False
    try:
        want = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise Unreadable(f"its checksum file {path} is unreadable ({e})") from None
    got = _files(step_dir)
    for name, (size, digest) in want.items():
        if name not in got:
            raise Unreadable(f"{name} is missing")
        if got[name][0] != size:
            raise Unreadable(f"{name} has {got[name][0]} bytes, {size} were written")
        if got[name][1] != digest:
            raise Unreadable(f"{name} does not match its checksum (its contents changed after the write)")
    return True


def set_aside(mngr: ocp.CheckpointManager, step_dir: Path, why: str) -> Path:
    """Move an unreadable step (or a half-written one) to checkpoints.unreadable/, keeping it."""
    where = Path(mngr.directory).parent / "checkpoints.unreadable" / f"{step_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
        where.parent.mkdir(exist_ok=True)
        step_dir.rename(where)
    warnings.warn(f"checkpoint {step_dir} {why}; moved to {where} (kept, never used)", stacklevel=3)
    mngr.reload()
    return where


def _restore_args(targets: dict):
    return ocp.args.Composite(**{
        k: ocp.args.JsonRestore() if k == "meta" else
        ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, v)) for k, v in targets.items()})


def restore_latest(mngr: ocp.CheckpointManager, targets: dict, mismatch=None):
    """Restore the newest usable step into the structure of `targets` (pure pytrees; `meta` is JSON).
    Unreadable steps are set aside on the way. `mismatch(meta, error)` is called when a verified step
    does not fit the targets (it should raise, naming the difference); without it that is a
    ValueError. Returns (step, restored) or (None, None) when there is no step at all."""
    directory = Path(mngr.directory)
    for stray in directory.glob("*.orbax-checkpoint-tmp*"):
        set_aside(mngr, stray, "was left half-written")
    for step in sorted(mngr.all_steps(), reverse=True):
        step_dir = directory / str(step)
        try:
            verified = verify(step_dir)
        except Unreadable as e:
            set_aside(mngr, step_dir, f"fails its checksums: {e}")
            continue
        try:
            return step, mngr.restore(step, args=_restore_args(targets))
        except Exception as e:  # noqa: BLE001 - sorted below: corrupt, or a config that does not fit
            if not verified:
                set_aside(mngr, step_dir, f"is unreadable ({type(e).__name__}: {str(e)[:200]})")
                continue
            meta = _read_meta(step_dir)
            if mismatch is not None:
                mismatch(meta, e)
            raise ValueError(f"checkpoint {step_dir} is intact but does not fit this model ({type(e).__name__}: "
                             f"{str(e)[:300]})") from None
    return None, None


def _read_meta(step_dir: Path) -> dict:
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def newest_meta(mngr: ocp.CheckpointManager) -> dict:
    """The meta (step, config, ...) of the newest step whose files verify, {} if none: what a resume
    compares the config against before restoring anything."""
    for step in sorted(mngr.all_steps(), reverse=True):
        step_dir = Path(mngr.directory) / str(step)
        try:
            verify(step_dir)
        except Unreadable:
            continue
        meta = _read_meta(step_dir)
        if meta:
            return meta
    return {}


def prune(mngr: ocp.CheckpointManager, keep: int):
    """Delete all but the newest `keep` steps (process 0 deletes; every process reloads)."""
    steps = sorted(mngr.all_steps())
    for step in steps[:-keep] if len(steps) > keep else ():
        mngr.delete(step)
    mngr.reload()


def split_adapters(params: dict) -> tuple[dict, list[dict], list[dict]]:
    """(params with each LowRank replaced by its base, the adapters [{a, b}], where they go [{path, in_ndim}])
    of a pure parameter dict (nnx.to_pure_dict) of a model with adapters (train/lora.py)."""
    adapters, where = [], []

    def walk(tree, path):
        if isinstance(tree, LowRank):
            adapters.append({"a": tree.a, "b": tree.b})
            where.append({"path": list(path), "in_ndim": tree.in_ndim})
            return tree.base
        if isinstance(tree, dict):
            return {k: walk(v, (*path, k)) for k, v in tree.items()}
        return tree

    return walk(params, ()), adapters, where


def _at(tree: dict, path: list):
    for k in path[:-1]:
        tree = tree[k]
    return tree, path[-1]


def join_adapters(params: dict, adapters: list[dict], where: list[dict], scale: float) -> dict:
    """The inverse of split_adapters (in place): each base at `where` becomes a LowRank with its adapter."""
    for adapter, w in zip(adapters, where, strict=True):
        parent, key = _at(params, w["path"])
        parent[key] = LowRank(base=parent[key], a=adapter["a"], b=adapter["b"], scale=scale, in_ndim=w["in_ndim"])
    return params


_quantized_form = None  # how a quantized run's model is built before it is read: infer/quantize.py's


def register_quantized_form(fn):
    """Set how a quantized run (train/compress.py) is read: fn(model, spec) gives the built model in the
    quantized form spec (its checkpoint meta's "quantized") names, the structure its parameters are read
    into. infer/quantize.py registers its quantized_like when imported (zoo cannot import infer)."""
    global _quantized_form
    _quantized_form = fn


def load_model(run_dir, step: int | None = None, mesh: Mesh | None = None, config=None):
    """(config, model with the latest (or given) checkpoint's parameters, step) from a run folder.
    On a `mesh` each parameter is read straight into its shards there (by the logical axes its layer
    names, zoo/sharding.py), whichever mesh wrote the checkpoint; without one, onto the default
    device. The config is the one saved with the checkpoint (config.yaml for older runs), or `config`
    (a YAML path), a model with the same parameters built otherwise: per-head attention masks from
    train/calibrate.py; a config whose parameters differ is refused, naming the first difference.
    A quantized run (train/compress.py; its meta's "quantized") is read into the quantized form it holds
    (register_quantized_form), on one device and with its own config."""
    run_dir = Path(run_dir)
    folder = run_dir / "checkpoints"
    if not folder.is_dir() or not (mngr := manager(folder, create=False)).all_steps():
        raise ValueError(f"{run_dir} is not a run folder with checkpoints (no {folder}/<step>)")
    meta = newest_meta(mngr) if step is None else _read_meta(folder / str(step))
    quantized = meta.get("quantized")
    if quantized and (_quantized_form is None or mesh is not None or config is not None):
        raise ValueError(f"{run_dir} holds a quantized model ({quantized['weights']} {quantized['method']}, python -m "
                         "train.compress): it is read on one device, with its own config, once infer is imported (its "
                         "quantized form is infer.quantize's)")
    saved = meta.get("config")
    if saved is None:
        try:
            saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{run_dir}: no readable config (checkpoints without one, config.yaml: {e})") from None
    cfg = from_dict(saved)
    lora = cfg.train.lora  # the adapters the checkpoint holds, whatever `config` says
    if config is not None:
        cfg = _same_parameters(cfg, load_config(config), config)
    plain = lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0))
    build = (lambda: _quantized_form(plain(), quantized)) if quantized else plain
    if mesh is None:
        graphdef, params, rest = nnx.split(build(), nnx.Param, ...)
    else:
        graphdef, params, rest, _ = init_on_mesh(build, mesh)
    targets = {"params": nnx.to_pure_dict(params)}
    if jax.tree.leaves(nnx.to_pure_dict(rest)):
        targets["rest"] = nnx.to_pure_dict(rest)
    where = meta.get("adapters") or []
    if where:  # a train.lora run: its adapters, (In, rank) and (rank, Out) beside each base
        rank = lora.rank
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        targets["adapters"] = []
        for w in where:
            parent, key = _at(targets["params"], w["path"])
            shape, dtype = parent[key].shape, parent[key].dtype
            In, Out = math.prod(shape[:w["in_ndim"]]), math.prod(shape[w["in_ndim"]:])
            targets["adapters"].append({"a": jax.device_put(jnp.zeros((In, rank), dtype), replicated),
                                        "b": jax.device_put(jnp.zeros((rank, Out), dtype), replicated)})
    if step is None:
        step, restored = restore_latest(mngr, targets)
        if step is None:
            raise ValueError(f"{run_dir} holds no readable checkpoint")
    else:
        restored = mngr.restore(step, args=_restore_args(targets))
    weights = restored["params"]
    if where:  # folded: W + (alpha / rank) A B
        weights = jax.tree.map(lambda x: x.merged() if isinstance(x, LowRank) else x,
                               join_adapters(weights, restored["adapters"], where, lora.scale),
                               is_leaf=lambda x: isinstance(x, LowRank))
    nnx.replace_by_pure_dict(params, weights)
    if "rest" in targets:
        nnx.replace_by_pure_dict(rest, restored["rest"])
    return cfg, nnx.merge(graphdef, params, rest), step


def load_any(path, *, dtype: str = "float32", mesh: Mesh | None = None):
    """(model, tokenizer) from a run folder of this zoo (its latest checkpoint; the run's tokenizer) or a
    Hugging Face model folder (config.json; zoo.hf.load, its tokenizer.json or None), in evaluation mode;
    a ValueError naming the folder when it is neither."""
    from zoo import tokenizer as tokenizer_lib

    folder = Path(path)
    if (folder / "config.json").is_file():
        from zoo.hf import load

        return load(folder, dtype=dtype, mesh=mesh)
    if not (folder / "checkpoints").is_dir():
        raise ValueError(f"{folder} is not a run folder with checkpoints (no {folder}/checkpoints) nor a Hugging Face "
                         "model folder (no config.json)")
    cfg, model, _ = load_model(folder, mesh=mesh)
    model.eval()
    return model, tokenizer_lib.for_run(folder, cfg.data.tokenizer)


def _same_parameters(saved, cfg, where):
    """cfg, after checking that its model has the parameter names and shapes of the saved config's."""
    shapes = lambda c: {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: LanguageModel(c.model, rngs=nnx.Rngs(0))), nnx.Param)))}
    a, b = shapes(saved), shapes(cfg)
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            raise ValueError(f"{where}: parameter {name} is {b.get(name)} there and {a.get(name)} in the checkpoint; "
                             "the config must build the saved parameters")
    return cfg
