"""Gated linear attention in the layout of flash-linear-attention's model hub (fla-hub/gla-*,
GLAForCausalLM): GLA mixer (its short convolutions when use_short_conv) and SwiGLU MLP blocks."""

from zoo.hf.convert import conv, fla_model_tensors, linear, refuse, same

ARCHITECTURES = {"GLAForCausalLM": "gla"}


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a flash-linear-attention GLA config.json: GLA mixer, SwiGLU MLP blocks
    (fla's GatedMLP: intermediate_size, else 2/3 of hidden_ratio x hidden_size rounded up to 256)."""
    refuse(hf, where, hidden_act=lambda v: v in (None, "swish", "silu"), feature_map=lambda v: v is None,
           clamp_min=lambda v: v is None, attn=lambda v: not v, attnres_block_size=lambda v: v is None,
           elementwise_affine=lambda v: v in (None, True),
           num_kv_heads=lambda v: v in (None, hf.get("num_heads", 4)))
    D = hf["hidden_size"]
    hidden = hf.get("intermediate_size") or 256 * -(-int(D * (hf.get("hidden_ratio") or 4) * 2 / 3) // 256)
    mixer = {"kind": "gla", "num_heads": hf.get("num_heads", 4), "expand_k": hf.get("expand_k", 0.5),
             "expand_v": hf.get("expand_v", 1.0), "conv_size": hf.get("conv_size", 4) if hf.get("use_short_conv")
             else 0, "use_output_gate": hf.get("use_output_gate", True), "norm_eps": hf.get("norm_eps", 1e-6)}
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"], "mixer": mixer,
            "ffn": {"kind": "mlp", "hidden_dim": hidden}, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": hf.get("norm_eps", 1e-6)}


def tensors(cfg, arch: str) -> list[tuple]:
    """fla's GLABlock names: attn_norm, attn (q/k/v/g/o projections, gk_proj's two matrices, the
    output norm, the short convolutions), mlp_norm, mlp."""
    m = cfg.mixer
    projections = ("q", "k", "v", "o") + (("g",) if m.use_output_gate else ())
    norm = "g_norm_swish_gate" if m.use_output_gate else "g_norm"  # fla's fused gate norm, or its plain one
    rows = fla_model_tensors(cfg)
    for i in range(cfg.num_layers):
        z, p = ("blocks", i), f"model.layers.{i}."
        att = p + "attn."
        rows += [(z + ("mixer_norm", "weight"), [p + "attn_norm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "mlp_norm.weight"], *same),
                 (z + ("mixer", "gk_down", "kernel"), [att + "gk_proj.0.weight"], *linear),
                 (z + ("mixer", "gk_up", "kernel"), [att + "gk_proj.1.weight"], *linear),
                 (z + ("mixer", "gk_up", "bias"), [att + "gk_proj.1.bias"], *same),
                 (z + ("mixer", "norm", "weight"), [att + norm + ".weight"], *same)]
        rows += [(z + ("mixer", f"{n}_proj", "kernel"), [att + f"{n}_proj.weight"], *linear) for n in projections]
        if m.conv_size:
            rows += [(z + ("mixer", f"conv_{n}", "weight"), [att + f"{n}_conv1d.weight"], *conv) for n in "qkv"]
        rows += [(z + ("ffn", w), [p + f"mlp.{n}_proj.weight"], *linear)
                 for w, n in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of GLA mixer and MLP blocks."""
    m = cfg.mixer
    if (m.gate_low_rank_dim, m.gate_logit_normalizer, m.norm_eps) != (16, 16, cfg.norm_eps):
        raise ValueError("zoo.hf.save: fla's GLA has gate_low_rank_dim 16, gate_logit_normalizer 16 and one "
                         f"epsilon for every norm; this GLA has {m.gate_low_rank_dim}, {m.gate_logit_normalizer}, "
                         f"mixer.norm_eps={m.norm_eps} and model.norm_eps={cfg.norm_eps}")
    return {"architectures": ["GLAForCausalLM"], "model_type": "gla", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_heads": m.num_heads,
            "expand_k": m.expand_k, "expand_v": m.expand_v, "use_short_conv": m.conv_size > 0,
            "conv_size": m.conv_size or 4, "use_output_gate": m.use_output_gate, "hidden_act": "swish",
            "intermediate_size": param_shapes[("blocks", 0, "ffn", "w_gate")][-1], "norm_eps": cfg.norm_eps,
            "fuse_norm": True, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
