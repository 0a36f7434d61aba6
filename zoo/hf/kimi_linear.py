"""Kimi Linear (transformers' KimiLinearForCausalLM): Kimi Delta Attention (kda) and multi-head latent
attention (mla) layers as layer_types says, dense SwiGLU MLPs and DeepSeek-V3's MoE as mlp_layer_types
says (model.layer_pattern, model.ffn_pattern).

The MLA is DeepSeek-V3's without rotary (rotary: false; transformers' KimiLinearAttention leaves the
qk_rope_head_dim channels unrotated and scales by (qk_nope_head_dim + qk_rope_head_dim)^-1/2), the
MoE DeepSeek-V3's (zoo/hf/deepseek.py), its experts named w1 (gate), w3 (up), w2 (down) under
block_sparse_moe as the dense MLPs are. The KDA layer is layers/deltanet.py's KimiDeltaAttention with
linear_num_heads heads of linear_head_dim, values as wide (expand_v 1), short convolutions of
linear_conv_kernel_dim, an output gate without bias (gate_bias: false) and its per-head output norm of
eps rms_norm_eps; A_log (1, 1, H, 1) is the zoo's (H,).

config.json in transformers' names (num_experts, num_experts_per_token, num_expert_group, moe_renormalize,
num_shared_experts, model_max_length) or in the original checkpoint's, whose linear_attn_config holds
head_dim, num_heads, short_conv_kernel_size and the 1-based full_attn_layers / kda_layers, read as
transformers reads them. Refused by name: layer_types or mlp_layer_types entries other than theirs,
moe_router_activation_func other than sigmoid, mla_use_nope false, moe_layer_freq other than 1,
attention_bias, hidden_act other than silu, num_key_value_heads other than num_attention_heads,
num_shared_experts 0. An FP8 quantization_config is dequantized as the folder is read (zoo.hf.convert.fp8_blocks).
"""

from zoo.hf.convert import conv, linear, one, outer_rows, refuse, same
from zoo.hf.deepseek import MLA_NORM_EPS, check_mla, checked_ffns, mla_dims, mla_rows, mlp_rows, moe_rows, moe_section

ARCHITECTURES = {"KimiLinearForCausalLM": "kimi_linear"}
MIXERS, FFNS = ("full_attention", "linear_attention"), ("dense", "sparse")
EXPERTS = (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))


def _get(hf: dict, *names, default=KeyError):
    """The first of `names` config.json has (transformers' and the original checkpoint's spellings); without a
    default, a KeyError naming the first when it has none (model_config's "no field")."""
    found = next((hf[n] for n in names if n in hf), default)
    if found is KeyError:
        raise KeyError(names[0])
    return found


def layer_kinds(hf: dict, where: str) -> tuple[list, list]:
    """(layer_types, mlp_layer_types) as transformers' KimiLinearConfig derives them."""
    L, linear_cfg = hf["num_hidden_layers"], hf.get("linear_attn_config") or {}
    mixers = hf.get("layer_types")
    if mixers is None and "full_attn_layers" in linear_cfg and "kda_layers" in linear_cfg:
        mixers = [None] * L
        for kind, layers in (("full_attention", linear_cfg["full_attn_layers"]),
                             ("linear_attention", linear_cfg["kda_layers"])):
            for i in layers:  # 1-based
                mixers[i - 1] = kind
    mixers = mixers or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    dense = hf.get("first_k_dense_replace", 1)
    ffns = hf.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(L)]
    refuse({"layer_types": mixers, "mlp_layer_types": ffns}, where,
           layer_types=lambda v: len(v) == L and set(v) <= set(MIXERS),
           mlp_layer_types=lambda v: len(v) == L and set(v) <= set(FFNS))
    return mixers, ffns


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Kimi Linear config.json: kda and mla mixers, MLP and MoE FFNs, as patterns."""
    H = hf["num_attention_heads"]
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
           moe_router_activation_func=lambda v: v in (None, "sigmoid"), mla_use_nope=lambda v: v in (None, True),
           moe_layer_freq=lambda v: v in (None, 1), num_key_value_heads=lambda v: v in (None, H),
           num_shared_experts=lambda v: v is None or v >= 1, n_shared_experts=lambda v: v is None or v >= 1)
    linear_cfg, eps = hf.get("linear_attn_config") or {}, hf.get("rms_norm_eps", 1e-5)
    mla = {"kind": "mla", "num_heads": H, "head_dim": hf["qk_nope_head_dim"], "v_head_dim": hf["v_head_dim"],
           "rope_dim": hf["qk_rope_head_dim"], "kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": hf.get("q_lora_rank"),
           "rotary": False, "norm_eps": MLA_NORM_EPS, "long_context": "full"}
    kda = {"kind": "kda", "num_heads": linear_cfg.get("num_heads", hf.get("linear_num_heads", 32)),
           "head_dim": linear_cfg.get("head_dim", hf.get("linear_head_dim", 128)), "expand_v": 1.0,
           "conv_size": linear_cfg.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
           "gate_bias": False, "norm_eps": eps}
    moe = moe_section(_get(hf, "num_experts", "num_local_experts", "n_routed_experts"),
                      _get(hf, "num_experts_per_token", "num_experts_per_tok"), hf["moe_intermediate_size"],
                      _get(hf, "moe_renormalize", "norm_topk_prob", default=True),
                      _get(hf, "num_expert_group", "n_group", default=1), hf.get("topk_group", 1),
                      hf["routed_scaling_factor"], _get(hf, "num_shared_experts", "n_shared_experts", default=1))
    mixers, ffns = layer_kinds(hf, where)
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "max_seq_len": _get(hf, "model_max_length", "max_position_embeddings"),
            "layer_pattern": [mla if k == "full_attention" else kda for k in mixers],
            "ffn_pattern": [{"kind": "mlp", "hidden_dim": hf["intermediate_size"]} if k == "dense" else moe
                            for k in ffns],
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": eps}


def kda_rows(z: tuple, att: str) -> list[tuple]:
    """The rows of a KDA mixer at zoo path z + ("mixer",) from transformers' KimiLinearDeltaAttention names under
    `att` (in the checkpoint's layout: q_conv1d / k_conv1d / v_conv1d, and f_a_proj ... A_log beside them)."""
    mix = z + ("mixer",)
    rows = [(mix + (f"{n}_proj", "kernel"), [f"{att}{n}_proj.weight"], *linear) for n in ("q", "k", "v", "o", "b")]
    rows += [(mix + (f"{n}_conv", "weight"), [f"{att}{n}_conv1d.weight"], *conv) for n in "qkv"]
    rows += [(mix + (w, "kernel"), [f"{att}{n}.weight"], *linear)
             for w, n in (("f_down", "f_a_proj"), ("f_up", "f_b_proj"), ("g_down", "g_a_proj"), ("g_up", "g_b_proj"))]
    return rows + [(mix + ("A_log",), [att + "A_log"], *one(lambda a: a.reshape(-1), lambda w: w.reshape(1, 1, -1, 1))),
                   (mix + ("dt_bias",), [att + "dt_bias"], *same),
                   (mix + ("o_norm", "weight"), [att + "o_norm.weight"], *same)]


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' KimiLinear names: model.embed_tokens, layers (self_attn: KDA or MLA; block_sparse_moe: a dense
    MLP or the MoE), model.norm."""
    rows = outer_rows(cfg)
    for i, (m, f) in enumerate(zip(cfg.mixers(), cfg.ffns())):
        z, p = ("blocks", i), f"model.layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "post_attention_layernorm.weight"], *same)]
        att, moe = p + "self_attn.", p + "block_sparse_moe."
        rows += mla_rows(m, cfg.d_model, z, att, interleaved=False) if m.KIND == "mla" else kda_rows(z, att)
        rows += mlp_rows(z, moe) if f.KIND == "mlp" else moe_rows(f, z, moe, EXPERTS)
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of kda and mla mixers (one config each) with SwiGLU MLP and MoE FFNs."""
    arch, mixers = "Kimi Linear", cfg.mixers()
    f, F, hidden = checked_ffns(cfg, param_shapes, arch)
    kdas, mlas = ([m for m in mixers if m.KIND == kind] for kind in ("kda", "mla"))
    if len(kdas) + len(mlas) != len(mixers) or any(m != kdas[0] for m in kdas) or any(m != mlas[0] for m in mlas):
        raise ValueError(f"zoo.hf.save: {arch}'s mixers are kda (one config) and mla (one config); this model has "
                         f"mixers {[m.KIND for m in mixers]}")
    k = kdas[0]  # zoo/hf/architectures.py sends models with kda here
    if k.expand_v != 1 or k.gate_bias or k.allow_neg_eigval or k.conv_size == 0 or k.norm_eps != cfg.norm_eps:
        raise ValueError(f"zoo.hf.save: {arch}'s KDA has expand_v 1, convolutions, no output-gate bias, beta in (0, 1) "
                         "and the model's norm epsilon")
    out = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
           "layer_types": ["full_attention" if m.KIND == "mla" else "linear_attention" for m in mixers],
           "linear_num_heads": k.num_heads, "linear_head_dim": k.head_dim or cfg.d_model // k.num_heads,
           "linear_conv_kernel_dim": k.conv_size,
           "mlp_layer_types": ["sparse" if x.KIND == "moe" else "dense" for x in cfg.ffns()],
           "intermediate_size": hidden, "moe_intermediate_size": F, "num_experts": f.num_experts,
           "num_experts_per_token": f.top_k, "num_shared_experts": f.num_shared_experts,
           "num_expert_group": f.num_groups, "topk_group": f.top_groups or f.num_groups,
           "moe_renormalize": f.renormalize, "routed_scaling_factor": f.routed_scale, "hidden_act": "silu",
           "model_max_length": cfg.max_seq_len or 2048, "rms_norm_eps": cfg.norm_eps,
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "torch_dtype": "float32",
           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # not Kimi's ids past a small vocabulary
    if mlas:  # without an mla layer transformers' defaults stand in, unused
        check_mla(mlas[0], arch, rotary=False)
        H, K, V, R, L = mla_dims(mlas[0], cfg.d_model)
        out.update(num_attention_heads=H, num_key_value_heads=H, q_lora_rank=mlas[0].q_lora_rank, kv_lora_rank=L,
                   qk_nope_head_dim=K, qk_rope_head_dim=R, v_head_dim=V)
    return out
