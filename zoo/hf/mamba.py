"""Mamba and Mamba-2 (transformers' MambaForCausalLM, Mamba2ForCausalLM): mixer-only blocks (ffn:
none); Mamba-2 with its own gated norm (norm_before_gate: false, per group, eps layer_norm_epsilon)."""

from zoo.hf.convert import conv, linear, number, outer_rows, refuse, same

ARCHITECTURES = {"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2"}


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Mamba or Mamba-2 config.json: mixer blocks without an FFN."""
    family = ARCHITECTURES[arch]
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), use_bias=lambda v: not v,
           use_conv_bias=lambda v: v in (None, True),
           time_step_limit=lambda v: v is None or [number(x) for x in v] == [0, float("inf")])
    D, expand = hf["hidden_size"], hf.get("expand", 2)
    mixer = {"kind": family, "state_size": hf["state_size"], "expand": expand, "conv_size": hf.get("conv_kernel", 4)}
    if family == "mamba":
        rank = hf.get("time_step_rank", "auto")
        mixer["dt_rank"] = -(-D // 16) if rank == "auto" else rank
    else:
        if hf["num_heads"] * hf["head_dim"] != expand * D:
            raise ValueError(f"{where}: num_heads={hf['num_heads']} x head_dim={hf['head_dim']} must equal expand x "
                             f"hidden_size = {expand * D}")
        mixer.update(head_dim=hf["head_dim"], num_groups=hf.get("n_groups", 1), norm_before_gate=False,
                     norm_eps=hf.get("layer_norm_epsilon", 1e-5))
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"], "mixer": mixer,
            "ffn": {"kind": "none"}, "tie_embeddings": bool(hf.get("tie_word_embeddings", family == "mamba")),
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5)}


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' MambaForCausalLM / Mamba2ForCausalLM names: backbone.embeddings, layers (norm, mixer), norm_f."""
    rows = outer_rows(cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    own = ("A_log", "D") + (("dt_bias", "norm.weight") if ARCHITECTURES[arch] == "mamba2" else ())
    for i in range(cfg.num_layers):
        z, p = ("blocks", i), f"backbone.layers.{i}."
        mix = p + "mixer."
        rows += [(z + ("mixer_norm", "weight"), [p + "norm.weight"], *same),
                 (z + ("mixer", "in_proj", "kernel"), [mix + "in_proj.weight"], *linear),
                 (z + ("mixer", "out_proj", "kernel"), [mix + "out_proj.weight"], *linear),
                 (z + ("mixer", "conv", "weight"), [mix + "conv1d.weight"], *conv),
                 (z + ("mixer", "conv", "bias"), [mix + "conv1d.bias"], *same)]
        rows += [(z + ("mixer", *n.split(".")), [mix + n], *same) for n in own]
        if ARCHITECTURES[arch] == "mamba":
            rows += [(z + ("mixer", "x_proj", "kernel"), [mix + "x_proj.weight"], *linear),
                     (z + ("mixer", "dt_proj", "kernel"), [mix + "dt_proj.weight"], *linear),
                     (z + ("mixer", "dt_bias"), [mix + "dt_proj.bias"], *same)]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of mamba or mamba2 mixers without FFN."""
    m = cfg.mixer
    if m.conv_size == 0 or m.KIND == "mamba2" and m.norm_before_gate:
        raise ValueError("zoo.hf.save: a Mamba saves for transformers with its convolution (conv_size > 0) and, for "
                         "Mamba-2, the official norm (norm_before_gate: false)")
    if m.KIND == "mamba2" and m.norm_eps != cfg.norm_eps:
        raise ValueError(f"zoo.hf.save: Mamba-2 uses one epsilon for every norm; mixer.norm_eps={m.norm_eps} and "
                         f"model.norm_eps={cfg.norm_eps} differ")
    out = {"architectures": ["MambaForCausalLM" if m.KIND == "mamba" else "Mamba2ForCausalLM"], "model_type": m.KIND,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
           "state_size": m.state_size, "expand": m.expand, "conv_kernel": m.conv_size,
           "layer_norm_epsilon": cfg.norm_eps,
           "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": True,
           "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
    if m.KIND == "mamba":
        out["time_step_rank"] = -(-cfg.d_model // 16) if m.dt_rank == "auto" else m.dt_rank
    else:
        out.update(num_heads=m.expand * cfg.d_model // m.head_dim, head_dim=m.head_dim, n_groups=m.num_groups)
    return out
