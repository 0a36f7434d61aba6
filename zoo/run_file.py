"""Reading a YAML run file into a checked Config: the file, then the `dotted.path=value` overrides,
then a model.init_from folder's config.json under the model section's own keys (zoo/hf), or the model
a train.distill.convert section makes from its teacher's, then every check of zoo/config.py. Above both
config and hf, so neither imports the other's reader."""

from pathlib import Path

import yaml

from zoo.config import Config, apply_overrides, from_dict, student_model, to_dict
from zoo.hf import derived_model_section, model_config, read_config


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
    distill = data.get("train", {}).get("distill") if isinstance(data.get("train"), dict) else None
    if isinstance(distill, dict) and distill.get("convert") is not None:
        data["model"] = _student_section(model, distill)
    return from_dict(data)


def _student_section(model, distill: dict) -> dict:
    """The model section a train.distill.convert section makes: its teacher's model (a run folder's
    config.yaml or a Hugging Face folder's config.json) with the chosen layers converted."""
    if model:
        raise ValueError("model: with train.distill.convert the model is the teacher's with the converted layers; "
                         "remove the model section")
    convert, teacher = distill["convert"], Path(str(distill.get("teacher")))
    if not isinstance(convert, dict):
        raise ValueError(f"train.distill.convert: expected a mapping of mixer and layers, got {convert!r}")
    if (teacher / "config.json").is_file():
        cfg = model_config(read_config(teacher), "float32", str(teacher / "config.json"))
    elif (teacher / "config.yaml").is_file():
        cfg = from_dict(yaml.safe_load((teacher / "config.yaml").read_text())).model
    else:
        raise ValueError(f"train.distill.teacher: {teacher} is not a run folder (no config.yaml) nor a Hugging Face "
                         "model folder (no config.json)")
    return to_dict(student_model(cfg, convert.get("mixer"), convert.get("layers")))
