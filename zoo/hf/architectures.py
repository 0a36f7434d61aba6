"""Which module reads and writes each Hugging Face architecture (config.json `architectures`): the
zoo config of a config.json, the tensor table of a model, and the config.json a model saves as."""

from zoo.config import ModelConfig, build_model
from zoo.hf import gla, llama, mamba, rwkv7

MODULES = (llama, mamba, gla, rwkv7)
ARCHITECTURES = {arch: family for module in MODULES for arch, family in module.ARCHITECTURES.items()}
MODULE_OF = {arch: module for module in MODULES for arch in module.ARCHITECTURES}


def architecture(hf: dict, where: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures={archs} is not supported; expected one of {', '.join(ARCHITECTURES)}")
    return archs[0]


def model_config(hf: dict, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The zoo ModelConfig of a config.json; a field it needs and lacks is a ValueError naming it."""
    arch = architecture(hf, where)
    try:
        section = MODULE_OF[arch].model_section(hf, arch, where)
    except KeyError as e:
        raise ValueError(f"{where}: no field {e.args[0]}, which {hf.get('architectures')} needs") from None
    return build_model({**section, "dtype": dtype}, f"{where} as model")


def tensors(cfg: ModelConfig, arch: str) -> list[tuple]:
    """(zoo parameter path, checkpoint names, names' arrays -> the zoo array, zoo array -> the arrays)."""
    return MODULE_OF[arch].tensors(cfg, arch)


def hf_config(cfg: ModelConfig, param_shapes: dict) -> dict:
    """The config.json of a zoo model `save` can write; a ValueError naming what it cannot."""
    m, f = cfg.mixer, cfg.ffn
    uniform = m is not None and f is not None  # one mixer and one FFN config for every layer
    if cfg.exits is not None or cfg.head != "lm" or cfg.residual.kind != "standard":
        raise ValueError("zoo.hf.save: early exits, model.head other than lm and model.residual other than standard "
                         "have no transformers equivalent")
    if (cfg.norm, cfg.embed_norm) != ("rms", False) and m.KIND != "rwkv7":
        raise ValueError("zoo.hf.save: LayerNorm blocks (model.norm: layer) and model.embed_norm have a Hugging Face "
                         "form only in fla's RWKV-7 layout")
    if uniform and m.KIND in ("mamba", "mamba2") and f.KIND == "none":
        return mamba.hf_config(cfg, param_shapes)
    if uniform and m.KIND == "gla" and f.KIND == "mlp":
        return gla.hf_config(cfg, param_shapes)
    if uniform and m.KIND == "rwkv7" and f.KIND == "rwkv7_channel_mix":
        return rwkv7.hf_config(cfg, param_shapes)
    if not uniform or m.KIND != "attention" or f.KIND not in ("mlp", "moe"):
        raise ValueError("zoo.hf.save: only attention mixers with mlp or moe FFNs, mamba / mamba2 mixers with ffn "
                         "none, gla with mlp or rwkv7 with its channel mix (fla's layouts) have a Hugging Face "
                         "architecture; this model has mixers "
                         f"{sorted({x.KIND for x in cfg.mixers()})} and ffns {sorted({x.KIND for x in cfg.ffns()})}")
    return llama.hf_config(cfg, param_shapes)
