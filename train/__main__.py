"""python -m train CONFIG [dotted.key=value ...]"""

import argparse
import dataclasses
import sys

from zoo.config import DataConfig, ModelConfig, TrainConfig, load_config
from zoo.registry import FFNS, MIXERS


def _help() -> str:
    parts = ["Config sections (YAML keys; override any with dotted.key=value):"]
    for cls in (ModelConfig, DataConfig, TrainConfig):
        parts.append("  " + " ".join(cls.__doc__.split()))
        parts.append("    defaults: " + ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)
                                                  if f.default is not dataclasses.MISSING))
    for title, table in (("model.mixer / model.layer_pattern[i]", MIXERS), ("model.ffn", FFNS)):
        parts.append(f"  {title} kinds:")
        for kind, cls in table.items():
            keys = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
            parts.append(f"    {kind}: {' '.join((cls.__doc__ or '').split())}\n      keys: {keys}")
    return "\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m train", description="Pretrain a zoo model from a YAML config.",
                                     epilog=_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a YAML file from configs/")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=2000 model.d_model=256")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from train.loop import default_run_dir, run  # after the config checks: imports jax
        run(cfg, default_run_dir(cfg, args.config))
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
