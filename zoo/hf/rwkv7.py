"""RWKV-7 in the layout of flash-linear-attention's model hub (fla-hub/rwkv7-*, RWKV7ForCausalLM):
time and channel mix in LayerNorm blocks (model.norm: layer, embed_norm for the first block's
pre_norm), as fla's blocks compute them."""

import numpy as np

from zoo.hf.convert import fla_model_tensors, linear, refuse, same

ARCHITECTURES = {"RWKV7ForCausalLM": "rwkv7"}


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a flash-linear-attention RWKV-7 config.json: LayerNorm blocks (with the
    embeddings' own norm when norm_first), RWKV-7 time mix and channel mix (intermediate_size, else
    hidden_ratio x hidden_size rounded up to 32)."""
    refuse(hf, where, hidden_act=lambda v: v in (None, "sqrelu"), attn=lambda v: not v,
           norm_bias=lambda v: v in (None, True), norm_eps=lambda v: v in (None, 1e-5),
           value_dim=lambda v: v is None or set(v if isinstance(v, list) else [v]) == {hf["hidden_size"]})
    D = hf["hidden_size"]
    head_dim = hf.get("head_dim") or D // hf["num_heads"]
    hidden = hf.get("intermediate_size") or 32 * -(-int(D * (hf.get("hidden_ratio") or 4)) // 32)
    mixer = {"kind": "rwkv7", "head_dim": head_dim, "decay_lora_dim": hf.get("decay_low_rank_dim", 64),
             "icl_lora_dim": hf.get("a_low_rank_dim", 64), "value_lora_dim": hf.get("v_low_rank_dim", 16),
             "gate_lora_dim": hf.get("gate_low_rank_dim", 128)}
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"], "mixer": mixer,
            "ffn": {"kind": "rwkv7_channel_mix", "hidden_dim": hidden}, "norm": "layer",
            "embed_norm": bool(hf.get("norm_first", True)), "norm_eps": 1e-5,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}


def tensors(cfg, arch: str) -> list[tuple]:
    """fla's RWKV7Attention / RWKV7FeedForward names for the zoo's RWKV-7 (the official model's
    parameters under other names: x_r..x_g the token-shift mixes, k_k / k_a / r_k the removal scale,
    replacement rate and bonus, each LoRA's lora.0 / lora.2 its two matrices, lora.2's bias its base)."""
    D = cfg.d_model
    mixes = (lambda a: np.stack([x.reshape(D) for x in a]), lambda w: [x.reshape(1, 1, D) for x in w])
    rows = fla_model_tensors(cfg)
    for i in range(cfg.num_layers):
        z, p = ("blocks", i), f"model.layers.{i}."
        att, mix = p + "attn.", z + ("mixer",)
        if i == 0 and cfg.embed_norm:
            rows += [(("embed_norm", n), [p + f"pre_norm.{n}"], *same) for n in ("weight", "bias")]
        rows += [(z + (norm, n), [p + f"{name}.{n}"], *same)
                 for norm, name in (("mixer_norm", "attn_norm"), ("ffn_norm", "ffn_norm")) for n in ("weight", "bias")]
        rows.append((mix + ("mu",), [att + f"x_{c}" for c in "rwkvag"], *mixes))
        rows += [(mix + (z_,), [att + n], *same) for z_, n in (
            ("removal_scale", "k_k"), ("replace_rate", "k_a"), ("bonus", "r_k"), ("ln_weight", "g_norm.weight"),
            ("ln_bias", "g_norm.bias"))]
        rows += [(mix + (f"w_{c}",), [att + f"{c}_proj.weight"], *linear) for c in "rkvo"]
        loras = [("decay", "w_lora", True), ("icl", "a_lora", True), ("gate", "g_lora", False)]
        loras += [("vres", "v_lora", True)] if i > 0 else []  # layer 0's v is v_first: no value residual
        for zoo_name, name, bias in loras:
            rows += [(mix + (f"{zoo_name}_a",), [att + f"{name}.lora.0.weight"], *linear),
                     (mix + (f"{zoo_name}_b",), [att + f"{name}.lora.2.weight"], *linear)]
            if bias:
                rows.append((mix + (f"{zoo_name}_base",), [att + f"{name}.lora.2.bias"], *same))
        rows += [(z + ("ffn", "mu_k"), [p + "ffn.x_k"], *same),
                 (z + ("ffn", "w_k"), [p + "ffn.key.weight"], *linear),
                 (z + ("ffn", "w_v"), [p + "ffn.value.weight"], *linear)]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of RWKV-7 time mix and channel mix blocks."""
    if cfg.norm != "layer" or cfg.norm_eps != 1e-5:
        raise ValueError("zoo.hf.save: fla's RWKV-7 has LayerNorm blocks (model.norm: layer) with norm_eps 1e-5 (its "
                         f"group norm's too); this model has norm {cfg.norm!r}, norm_eps {cfg.norm_eps}")
    m = cfg.mixer
    rank = lambda name: param_shapes[("blocks", 0, "mixer", f"{name}_a")][-1]
    out = {"architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "head_dim": m.head_dim,
           "num_heads": cfg.d_model // m.head_dim, "decay_low_rank_dim": rank("decay"),
           "a_low_rank_dim": rank("icl"), "gate_low_rank_dim": rank("gate"),
           "intermediate_size": param_shapes[("blocks", 0, "ffn", "w_k")][-1], "hidden_act": "sqrelu",
           "norm_first": cfg.embed_norm, "norm_bias": True, "norm_eps": cfg.norm_eps,
           "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
    if cfg.num_layers > 1:
        out["v_low_rank_dim"] = param_shapes[("blocks", 1, "mixer", "vres_a")][-1]
    return out
