"""python -m train CONFIG [dotted.key=value ...]

On several hosts, start the same command on each with JAX_COORDINATOR_ADDRESS=host0:port,
JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=0..N-1 (or under SLURM, Open MPI or Kubernetes with
JAX_COORDINATOR_ADDRESS alone: jax reads the rest from the cluster); see docs/devices.md.
"""

import argparse
import dataclasses
import os
import sys

from zoo import load_config
from zoo.config import DataConfig, ExitsConfig, MeshConfig, ModelConfig, TokenizerConfig, TrainConfig
from zoo.registry import FFNS, MIXERS
from zoo.schema import to_dict


def _help() -> str:
    parts = ["Config sections (YAML keys; override any with dotted.key=value):"]
    for cls in (ModelConfig, ExitsConfig, DataConfig, TokenizerConfig, TrainConfig, MeshConfig):
        parts.append("  " + " ".join(cls.__doc__.split()))
        parts.append("    defaults: " + ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)
                                                  if f.default is not dataclasses.MISSING))
    for title, table in (("model.mixer / model.layer_pattern[i]", MIXERS), ("model.ffn", FFNS)):
        parts.append(f"  {title} kinds:")
        for kind, cls in table.items():
            keys = ", ".join(f"{f.name}={to_dict(f.default)!r}" for f in dataclasses.fields(cls))  # YAML's form
            parts.append(f"    {kind}: {' '.join((cls.__doc__ or '').split())}\n      keys: {keys}")
    return "\n".join(parts)


def initialize_distributed():
    """Join a multi-process run (`jax.distributed.initialize`) when JAX_COORDINATOR_ADDRESS is set;
    the process count and id come from JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from the cluster."""
    if not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return
    import jax

    env = {k: int(os.environ[v]) for k, v in (("num_processes", "JAX_NUM_PROCESSES"),
                                              ("process_id", "JAX_PROCESS_ID")) if os.environ.get(v)}
    jax.distributed.initialize(**env)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description="Pretrain a zoo model from a YAML config.",
                                epilog=_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a YAML file from configs/")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=2000 model.d_model=256")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a run folder whose checkpoints were written with another config (the learning "
                        "rate, the data, the steps...): the changes are printed and config.yaml is rewritten, "
                        "the previous one kept beside it; without it such a resume is refused")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        initialize_distributed()  # before anything asks jax for its devices
        from train.loop import default_run_dir, run  # after the config checks: imports jax
        run(cfg, default_run_dir(cfg, args.config), allow_config_change=args.allow_config_change)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
