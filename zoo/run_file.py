"""Reading a YAML run file into a checked Config: the file, then the `dotted.path=value` overrides,
then a model.init_from folder's config.json under the model section's own keys (zoo/hf), then every
check of zoo/config.py. Above both config and hf, so neither imports the other's reader."""

from pathlib import Path

import yaml

from zoo.config import Config, apply_overrides, from_dict
from zoo.hf import derived_model_section


def load_config(path, overrides=None) -> Config:
    """Read a YAML run file, apply overrides, and check everything. ValueError names what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"config {str(path)!r} cannot be read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):  # a YAML list or scalar at the top: there is no section to read
        raise ValueError(f"config {str(path)!r}: expected a mapping of sections (model, data, train), got "
                         f"{type(data).__name__} {data!r}")
    data = apply_overrides(data, overrides)
    model = data.get("model")
    if isinstance(model, dict) and model.get("init_from") is not None:
        data["model"] = derived_model_section(model)
    return from_dict(data)
