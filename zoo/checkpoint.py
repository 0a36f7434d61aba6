"""Orbax checkpoints of a run: `runs/<name>/checkpoints/<step>/{params,rest,opt_state,meta}`.

Sharded arrays are written shard by shard (each process its own) and read back into whatever
shardings the restore targets carry, so a checkpoint moves between meshes and onto one device.

Orbax writes each step into a temporary folder and renames it when complete, so a process killed
mid-write leaves no folder that looks finished. A step folder that still fails to restore (copied
half, truncated by hand) is skipped with a warning and the next older one is used.
"""

import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import yaml
from flax import nnx
from jax.sharding import Mesh

from zoo.config import from_dict
from zoo.model import LanguageModel
from zoo.sharding import init_on_mesh


def manager(directory: Path, keep: int | None = None, create: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=create)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _restore_args(targets: dict):
    return ocp.args.Composite(**{
        k: ocp.args.JsonRestore() if k == "meta" else
        ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, v)) for k, v in targets.items()})


def restore_latest(mngr: ocp.CheckpointManager, targets: dict):
    """Restore the newest complete step into the structure of `targets` (pure pytrees; `meta` is
    JSON). Returns (step, restored) or (None, None) when there is no usable checkpoint."""
    for stray in Path(mngr.directory).glob("*.orbax-checkpoint-tmp*"):
        warnings.warn(f"checkpoint {stray} was left half-written; ignoring it", stacklevel=2)
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            return step, mngr.restore(step, args=_restore_args(targets))
        except Exception as e:  # noqa: BLE001 - any unreadable step is skipped, never loaded
            warnings.warn(f"checkpoint step {step} in {mngr.directory} is incomplete or unreadable "
                          f"({type(e).__name__}: {str(e)[:200]}); skipping it", stacklevel=2)
    return None, None


def load_model(run_dir, step: int | None = None, mesh: Mesh | None = None):
    """(config, model with the latest (or given) checkpoint's parameters, step) from a run folder.
    On a `mesh` each parameter is read straight into its shards there (by the logical axes its layer
    names, zoo/sharding.py), whichever mesh wrote the checkpoint; without one, onto the default device."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ValueError(f"{run_dir} is not a run folder (no config.yaml)")
    cfg = from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if mesh is None:
        graphdef, params, rest = nnx.split(LanguageModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    else:
        graphdef, params, rest, _ = init_on_mesh(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)), mesh)
    targets = {"params": nnx.to_pure_dict(params)}
    if jax.tree.leaves(nnx.to_pure_dict(rest)):
        targets["rest"] = nnx.to_pure_dict(rest)
    mngr = manager(run_dir / "checkpoints", create=False)
    if step is None:
        step, restored = restore_latest(mngr, targets)
        if step is None:
            raise ValueError(f"{run_dir} holds no complete checkpoint")
    else:
        restored = mngr.restore(step, args=_restore_args(targets))
    nnx.replace_by_pure_dict(params, restored["params"])
    if "rest" in targets:
        nnx.replace_by_pure_dict(rest, restored["rest"])
    return cfg, nnx.merge(graphdef, params, rest), step
