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
from zoo.hf.architectures import architecture, hf_config, ignored, model_config, scales, tensors
from zoo.hf.convert import dequantize, fp8_blocks
from zoo.model import DTYPES, LanguageModel
from zoo.schema import to_dict
from zoo.sharding import state_shardings
from zoo.tokenizer import HFTokenizer

IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older Llama checkpoints carry; recomputed here
FLOAT8 = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16")  # an FP8 weight's scales; bytes (e8m0 exponents: DeepSeek-V4) refused


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


def _variables(cfg: ModelConfig, arch: str) -> set[tuple]:
    """The paths of the model's variables that the checkpoint holds (the tensor table's)."""
    return {p for row in tensors(cfg, arch) for p in (row[0] if isinstance(row[0], list) else [row[0]])}


def _read(checkpoint: dict, name: str, blocks, dtype) -> tuple[np.ndarray, list[str]]:
    """(tensor `name` of the checkpoint, the names read for it): a float8 one dequantized to `dtype` with the
    scales of its blocks (`blocks`: config.json's FP8 quantization_config, convert.fp8_blocks), read from the
    tensor <name>_scale_inv beside it; any other as it is stored."""
    f = checkpoint[name]
    if f.dtype(name) not in FLOAT8:
        return f.get(name), [name]
    scale = name + "_scale_inv"
    if blocks is None:
        raise ValueError(f"{f.path}: tensor {name} is {f.dtype(name)}, but config.json has no quantization_config "
                         "of quant_method fp8 to say its scales' blocks")
    if scale not in checkpoint:
        raise ValueError(f"{f.path}: tensor {name} is {f.dtype(name)}, but the checkpoint has no {scale}, its "
                         "scales, beside it")
    shape, s = f.shape(name), checkpoint[scale]
    grid = shape[:-2] + tuple(-(-n // b) for n, b in zip(shape[-2:], blocks))
    if len(shape) < 2 or s.shape(scale) != grid or s.dtype(scale) not in SCALE_DTYPES:
        raise ValueError(f"{s.path}: tensor {scale} is {s.dtype(scale)} {list(s.shape(scale))}, but {name}'s "
                         f"{list(shape)} in blocks of {list(blocks)} needs float scales of shape {list(grid)}")
    return dequantize(f.get(name), s.get(scale), blocks, dtype), [name, scale]


def stored(cfg: ModelConfig, arch: str):
    """An nnx filter of what a checkpoint holds: the parameters, and the state the tensor table names
    besides them (an MoE's RouterBias: DeepSeek-V3's e_score_correction_bias)."""
    named = _variables(cfg, arch)
    return nnx.Any(nnx.Param, lambda path, _: tuple(path) in named)


def read_params(path, cfg: ModelConfig, params, shardings=None, dtype=None):
    """`params` (an nnx.State of the model `cfg` makes, abstract or not, holding what `stored` picks) with
    every value read from the checkpoint in folder `path`, one tensor at a time (an FP8 one dequantized with its
    blocks' scales to the parameter's dtype as it is read: convert.fp8_blocks), times the factor config.json's
    multipliers fold into it (architectures.scales: Falcon-H1's), cast to `dtype` (default: each parameter's own)
    and placed with `shardings` (an nnx.State of NamedShardings like params) when given."""
    folder = Path(path)
    hf = read_config(folder)
    arch = architecture(hf, str(folder / "config.json"))
    blocks = fp8_blocks(hf, str(folder / "config.json"))
    folded = scales(cfg, arch, hf)  # config.json's multipliers, folded into the weights they scale
    checkpoint = _open_checkpoint(folder)
    flat = dict(nnx.to_flat_state(params))
    dtype_of = lambda p: DTYPES[dtype] if dtype else flat[p].dtype  # what parameter p is read as
    lacking = sorted(_variables(cfg, arch) - set(flat), key=str)
    if lacking:
        raise ValueError(f"{folder}: {arch} holds the model's {'.'.join(map(str, lacking[0]))}, which the state to "
                         "fill lacks (zoo.hf.folder.stored picks the variables a checkpoint holds)")
    placed = {p: v.get_value() if isinstance(v, nnx.Variable) else v
              for p, v in (nnx.to_flat_state(shardings) if shardings is not None else ())}
    used = set()
    for zpath, names, to_zoo, to_hf in tensors(cfg, arch):
        zpaths = zpath if isinstance(zpath, list) else [zpath]  # a list: parameters that share fused tensors
        expected = [a.shape for a in to_hf(*(np.empty(flat[p].shape, np.float32) for p in zpaths))]  # untouched
        arrays = []
        for name, shape in zip(names, expected):
            if name not in checkpoint:
                raise ValueError(f"{folder}: the checkpoint has no tensor {name}, which {arch} with this config.json "
                                 "needs")
            found = checkpoint[name].shape(name)
            if found != shape:
                raise ValueError(f"{checkpoint[name].path}: tensor {name} has shape {found}, but config.json implies "
                                 f"{shape}")
            array, read = _read(checkpoint, name, blocks, dtype_of(zpaths[0]))
            arrays.append(array)
            used.update(read)
        for p, value in zip(zpaths, to_zoo(arrays) if isinstance(zpath, list) else [to_zoo(arrays)], strict=True):
            value = np.asarray(value) * folded[p] if p in folded else np.asarray(value)
            value = value.astype(dtype_of(p), copy=False)
            flat[p].set_value(jax.device_put(value, placed.get(p), may_alias=False))  # copied: the file stays free
    extra = sorted(n for n in checkpoint
                   if n not in used and not n.endswith(IGNORED_TENSORS) and not n.startswith(ignored(arch, hf)))
    if extra:
        raise ValueError(f"{folder}: the checkpoint holds tensors {arch} with this config.json has no place for: "
                         f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return nnx.from_flat_state(flat)


def load(path, *, dtype: str = "float32", mesh=None) -> tuple[LanguageModel, HFTokenizer | None]:
    """(model, tokenizer) from a local Hugging Face model folder; tokenizer None without tokenizer.json.
    Parameters are stored in `dtype` (float32 or bfloat16), which is also the compute dtype."""
    folder = Path(path)
    hf, where = read_config(folder), str(folder / "config.json")
    cfg = model_config(hf, dtype, where)
    build = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(build)
    checkpointed = stored(cfg, architecture(hf, where))
    graphdef, params, _ = nnx.split(abstract, checkpointed, ...)
    rest = jax.jit(lambda: nnx.state(build(), nnx.Not(checkpointed)))()  # the weights are dead code: never made
    shardings = state_shardings(abstract, mesh)[0] if mesh is not None else None
    model = nnx.merge(graphdef, read_params(folder, cfg, params, shardings, dtype), rest)
    model.eval()
    tok = folder / "tokenizer.json"
    return model, HFTokenizer(tok) if tok.is_file() else None


def derived_model_section(model: dict) -> dict:
    """The `model` section of a run with model.init_from=FOLDER: config.json's model, with the
    section's own keys on top (mixer and ffn key by key; a layer_pattern or ffn_pattern whole)."""
    folder = Path(model["init_from"])
    derived = to_dict(model_config(read_config(folder), model.get("dtype", "float32"), str(folder / "config.json")))
    out = {**derived, **{k: v for k, v in model.items() if k not in ("mixer", "ffn")}}
    for key, pattern in (("mixer", "layer_pattern"), ("ffn", "ffn_pattern")):
        own = model.get(key) or {}
        if model.get(pattern) is not None:  # the section's own list replaces config.json's one config
            out[key] = None
            continue
        if not isinstance(own, dict):
            raise ValueError(f"model.{key}: expected a mapping of keys to set on {folder / 'config.json'}'s, got "
                             f"{type(own).__name__} {own!r}")
        if derived[key] is None:  # config.json's model has one per layer
            if own:
                raise ValueError(f"model.{key}: {folder / 'config.json'}'s model has a {pattern}, one {key} per layer; "
                                 f"give model.{pattern} (the whole list) to change it")
            continue
        out[key] = {**derived[key], **own}
    return out


def save(model: LanguageModel, path, tokenizer: HFTokenizer | None = None):
    """Write `model` as a Hugging Face folder (config.json, model.safetensors in float32, and the
    tokenizer's tokenizer.json when given) that `load` and transformers read with the same logits. A model
    loaded from an FP8 folder is written as its dequantized float weights, without quantization_config."""
    flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model))}  # parameters and state (a router's bias)
    config = hf_config(model.cfg, {p: v.shape for p, v in flat.items()})
    arch = config["architectures"][0]
    out = {}
    for zpath, names, _, to_hf in tensors(model.cfg, arch):
        zpaths = zpath if isinstance(zpath, list) else [zpath]
        values = [np.asarray(jax.device_get(flat[p][...]), np.float32) for p in zpaths]
        out.update(zip(names, (np.ascontiguousarray(a) for a in to_hf(*values))))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.write(folder / "model.safetensors", out, {"format": "pt"})
    if tokenizer is not None:
        tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
        if tokenizer.eos_id is not None:
            config["eos_token_id"] = tokenizer.eos_id
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
