"""Which module reads and writes each Hugging Face architecture (config.json `architectures`): the
zoo config of a config.json, the tensor table of a model, and the config.json a model saves as."""

from zoo.config import ModelConfig, build_model
from zoo.hf import (
    deepseek,
    falcon_h1,
    gla,
    jamba,
    kimi_linear,
    lfm2,
    llama,
    mamba,
    nemotron_h,
    qwen3_next,
    recurrent_gemma,
    rwkv7,
)
from zoo.hf.convert import fp8_blocks

MODULES = (llama, mamba, gla, rwkv7, lfm2, jamba, qwen3_next, nemotron_h, falcon_h1, deepseek, kimi_linear,
           recurrent_gemma)
ARCHITECTURES = {arch: family for module in MODULES for arch, family in module.ARCHITECTURES.items()}
MODULE_OF = {arch: module for module in MODULES for arch in module.ARCHITECTURES}


def architecture(hf: dict, where: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures={archs} is not supported; expected one of {', '.join(ARCHITECTURES)}")
    return archs[0]


def model_config(hf: dict, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The zoo ModelConfig of a config.json; a field it needs and lacks is a ValueError naming it, as is a
    quantization_config other than the FP8 one `load` dequantizes (convert.fp8_blocks)."""
    arch = architecture(hf, where)
    fp8_blocks(hf, where)
    try:
        section = MODULE_OF[arch].model_section(hf, arch, where)
    except KeyError as e:
        raise ValueError(f"{where}: no field {e.args[0]}, which {hf.get('architectures')} needs") from None
    return build_model({**section, "dtype": dtype}, f"{where} as model")


def tensors(cfg: ModelConfig, arch: str) -> list[tuple]:
    """(zoo parameter path, checkpoint names, names' arrays -> the zoo array, zoo array -> the arrays)."""
    return MODULE_OF[arch].tensors(cfg, arch)


def scales(cfg: ModelConfig, arch: str, hf: dict) -> dict:
    """Zoo parameter path -> the factor its array is multiplied by as it is read from a folder of config.json `hf`:
    the multipliers an architecture folds into the weights (Falcon-H1's); none for the others."""
    module = MODULE_OF[arch]
    return module.scales(cfg, hf) if hasattr(module, "scales") else {}


def ignored(arch: str, hf: dict) -> tuple[str, ...]:
    """Name prefixes of checkpoint tensors the architecture's model of config.json `hf` has no use for, as
    transformers skips them too (the multi-token-prediction layers: Qwen3-Next's mtp.*, DeepSeek-V3's last; Qwen3.5's
    vision tower, model.visual.*)."""
    module = MODULE_OF[arch]
    return module.ignored_prefixes(hf) if hasattr(module, "ignored_prefixes") else ()


def hf_config(cfg: ModelConfig, param_shapes: dict) -> dict:
    """The config.json of a zoo model `save` can write; a ValueError naming what it cannot."""
    m, f = cfg.mixer, cfg.ffn
    uniform = m is not None and f is not None  # one mixer and one FFN config for every layer
    if cfg.exits is not None or cfg.head != "lm" or cfg.residual.kind != "standard":
        raise ValueError("zoo.hf.save: early exits, model.head other than lm and model.residual other than standard "
                         "have no transformers equivalent")
    if (cfg.norm, cfg.embed_norm) != ("rms", False) and getattr(m, "KIND", None) != "rwkv7":
        raise ValueError("zoo.hf.save: LayerNorm blocks (model.norm: layer) and model.embed_norm have a Hugging Face "
                         "form only in fla's RWKV-7 layout")
    kinds = {x.KIND for x in cfg.mixers()}
    if "rglru" in kinds:
        return recurrent_gemma.hf_config(cfg, param_shapes)
    gemma = [cfg.embed_scale is not None, cfg.logit_softcap is not None,
             any(getattr(x, "out_bias", False) for x in cfg.mixers()),
             any(x.KIND == "mlp" and (x.bias or x.activation == "geglu") for x in cfg.ffns())]
    if any(gemma):
        raise ValueError("zoo.hf.save: model.embed_scale, model.logit_softcap, attention's out_bias and an mlp with "
                         "bias or activation geglu have a Hugging Face form only in RecurrentGemma (with rglru layers)")
    if "parallel" in kinds:
        return falcon_h1.hf_config(cfg, param_shapes)  # Mamba-2 beside attention in every layer
    if kinds == {"mla"}:
        return deepseek.hf_config(cfg, param_shapes)
    if "kda" in kinds:
        return kimi_linear.hf_config(cfg, param_shapes)
    if "gated_conv" in kinds and kinds <= {"gated_conv", "attention"}:
        return lfm2.hf_config(cfg, param_shapes)
    if "gated_deltanet" in kinds or any(x.KIND == "attention" and x.output_gate == "channel" for x in cfg.mixers()):
        return qwen3_next.hf_config(cfg, param_shapes)  # Gated DeltaNet and / or gated attention
    if "mamba" in kinds and (not uniform or f.KIND != "none" or m.inner_norms):  # Jamba's layers, or its mamba
        return jamba.hf_config(cfg, param_shapes)
    if "mamba2" in kinds and not (uniform and f.KIND == "none") or any(  # Nemotron-H's layers, or its MLP
            getattr(x, "activation", None) == "relu2" for x in cfg.ffns()):
        return nemotron_h.hf_config(cfg, param_shapes)
    if uniform and m.KIND in ("mamba", "mamba2") and f.KIND == "none":
        return mamba.hf_config(cfg, param_shapes)
    if uniform and m.KIND == "gla" and f.KIND == "mlp":
        return gla.hf_config(cfg, param_shapes)
    if uniform and m.KIND == "rwkv7" and f.KIND == "rwkv7_channel_mix":
        return rwkv7.hf_config(cfg, param_shapes)
    if not uniform or m.KIND != "attention" or f.KIND not in ("mlp", "moe"):
        raise ValueError("zoo.hf.save: only attention mixers with mlp or moe FFNs, mamba / mamba2 mixers with ffn "
                         "none, gla with mlp, rwkv7 with its channel mix (fla's layouts), gated_conv with attention "
                         "and mlp (LFM2), mamba with attention (Jamba), mamba2 with attention and relu2 mlp "
                         "(Nemotron-H), parallel mamba2 and attention with mlp (Falcon-H1) or rglru with attention "
                         "(RecurrentGemma) have a Hugging Face architecture; this model has mixers "
                         f"{sorted({x.KIND for x in cfg.mixers()})} and ffns {sorted({x.KIND for x in cfg.ffns()})}")
    return llama.hf_config(cfg, param_shapes)
