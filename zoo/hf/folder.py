"""Reading and writing a Hugging Face model folder, whatever its architecture: config.json, the
safetensors checkpoint (one file or shards) and tokenizer.json. zoo/hf/architectures.py says, per
architecture, what the config and the tensors mean."""

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from zoo import safetensors
from zoo.config import ModelConfig
from zoo.hf.architectures import architecture, hf_config, model_config, tensors
from zoo.model import DTYPES, LanguageModel
from zoo.schema import to_dict
from zoo.sharding import state_shardings
from zoo.tokenizer import HFTokenizer

IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older Llama checkpoints carry; recomputed here


def read_config(folder) -> dict:
    f = Path(folder) / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: a Hugging Face model folder needs a readable config.json ({e})") from None


def _open_checkpoint(folder: Path) -> dict[str, safetensors.SafetensorsFile]:
    """Tensor name -> the open file that holds it (one model.safetensors, or the index's shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: safetensors.SafetensorsFile(folder / name) for name in sorted(set(weight_map.values()))}
        for name, file in weight_map.items():
            if name not in files[file].keys():
                raise ValueError(f"{folder / file}: holds no tensor {name}, which {index.name} places there")
        return {name: files[file] for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
                         "checkpoints are read)")
    f = safetensors.SafetensorsFile(single)
    return {name: f for name in f.keys()}


def read_params(path, cfg: ModelConfig, params, shardings=None, dtype=None):
    """`params` (an nnx.State of the model `cfg` makes, abstract or not) with every value read from the
    checkpoint in folder `path`, one tensor at a time, cast to `dtype` (default: each parameter's own)
    and placed with `shardings` (an nnx.State of NamedShardings like params) when given."""
    folder = Path(path)
    arch = architecture(read_config(folder), str(folder / "config.json"))
    checkpoint = _open_checkpoint(folder)
    flat = dict(nnx.to_flat_state(params))
    placed = {p: v.get_value() if isinstance(v, nnx.Variable) else v
              for p, v in (nnx.to_flat_state(shardings) if shardings is not None else ())}
    used = set()
    for zpath, names, to_zoo, to_hf in tensors(cfg, arch):
        expected = [a.shape for a in to_hf(np.empty(flat[zpath].shape, np.float32))]  # no memory is touched
        arrays = []
        for name, shape in zip(names, expected):
            if name not in checkpoint:
                raise ValueError(f"{folder}: the checkpoint has no tensor {name}, which {arch} with this config.json "
                                 "needs")
            found = checkpoint[name].shape(name)
            if found != shape:
                raise ValueError(f"{checkpoint[name].path}: tensor {name} has shape {found}, but config.json implies "
                                 f"{shape}")
            arrays.append(checkpoint[name].get(name))
        used.update(names)
        value = np.asarray(to_zoo(arrays)).astype(DTYPES[dtype] if dtype else flat[zpath].dtype, copy=False)
        flat[zpath].set_value(jax.device_put(value, placed.get(zpath), may_alias=False))  # copied: the file stays free
    extra = sorted(n for n in checkpoint if n not in used and not n.endswith(IGNORED_TENSORS))
    if extra:
        raise ValueError(f"{folder}: the checkpoint holds tensors {arch} with this config.json has no place for: "
                         f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return nnx.from_flat_state(flat)


def load(path, *, dtype: str = "float32", mesh=None) -> tuple[LanguageModel, HFTokenizer | None]:
    """(model, tokenizer) from a local Hugging Face model folder; tokenizer None without tokenizer.json.
    Parameters are stored in `dtype` (float32 or bfloat16), which is also the compute dtype."""
    folder = Path(path)
    cfg = model_config(read_config(folder), dtype, str(folder / "config.json"))
    build = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(build)
    graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
    rest = jax.jit(lambda: nnx.state(build(), nnx.Not(nnx.Param)))()  # the weights are dead code: never made
    shardings = state_shardings(abstract, mesh)[0] if mesh is not None else None
    model = nnx.merge(graphdef, read_params(folder, cfg, params, shardings, dtype), rest)
    model.eval()
    tok = folder / "tokenizer.json"
    return model, HFTokenizer(tok) if tok.is_file() else None


def derived_model_section(model: dict) -> dict:
    """The `model` section of a run with model.init_from=FOLDER: config.json's model, with the
    section's own keys on top (mixer and ffn key by key)."""
    folder = Path(model["init_from"])
    derived = to_dict(model_config(read_config(folder), model.get("dtype", "float32"), str(folder / "config.json")))
    out = {**derived, **{k: v for k, v in model.items() if k not in ("mixer", "ffn")}}
    for key in ("mixer", "ffn"):
        own = model.get(key) or {}
        if not isinstance(own, dict):
            raise ValueError(f"model.{key}: expected a mapping of keys to set on {folder / 'config.json'}'s, got "
                             f"{type(own).__name__} {own!r}")
        out[key] = {**derived[key], **own}
    return out


def save(model: LanguageModel, path, tokenizer: HFTokenizer | None = None):
    """Write `model` as a Hugging Face folder (config.json, model.safetensors in float32, and the
    tokenizer's tokenizer.json when given) that `load` and transformers read with the same logits."""
    flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    config = hf_config(model.cfg, {p: v.shape for p, v in flat.items()})
    arch = config["architectures"][0]
    out = {}
    for zpath, names, _, to_hf in tensors(model.cfg, arch):
        value = np.asarray(jax.device_get(flat[zpath][...]), np.float32)
        out.update(zip(names, (np.ascontiguousarray(a) for a in to_hf(value))))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.write(folder / "model.safetensors", out, {"format": "pt"})
    if tokenizer is not None:
        tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
        if tokenizer.eos_id is not None:
            config["eos_token_id"] = tokenizer.eos_id
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
