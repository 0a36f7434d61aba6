"""LFM2 (transformers' Lfm2ForCausalLM, Liquid AI's LFM2 checkpoints): pre-norm blocks of either LFM2's gated
short convolution (mixer gated_conv, layers/gated_conv.py) or attention with a per-head RMSNorm of queries
and keys (qk_norm) and rotary, each with a SwiGLU MLP of one width for every block; layer_types (or
full_attn_idxs) says which layer is which, so the zoo model has a layer_pattern of one mixer per layer.

The MLP's width is derived, as transformers derives it: with block_auto_adjust_ff_dim, int(2/3 of
intermediate_size) (block_ff_dim in older config.json files), times block_ffn_dim_multiplier, rounded up to a
multiple of block_multiple_of. The final norm is transformers' model.embedding_norm (applied after the
last block, despite its name); every norm, the query and key norms included, has eps norm_eps and the plain
weight (x / rms(x) * w).
"""

from zoo.hf.convert import conv, linear, one, outer_rows, same
from zoo.hf.llama import ROPE_KEYS, rope
from zoo.schema import to_dict

ARCHITECTURES = {"Lfm2ForCausalLM": "lfm2"}
THETA = 1e6  # Lfm2Config's rope_theta when config.json gives none


def ffn_width(hf: dict) -> int:
    """The MLP's hidden width, as transformers' Lfm2MLP computes it from config.json."""
    width = hf["block_ff_dim"] if "block_ff_dim" in hf else hf["intermediate_size"]
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiple = hf.get("block_multiple_of", 256)
            width = int(hf.get("block_ffn_dim_multiplier", 1.0) * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def layer_types(hf: dict, where: str) -> list[str]:
    """Each layer's type, "conv" or "full_attention": layer_types, else from full_attn_idxs (default: all attention)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        idxs = hf.get("full_attn_idxs")
        types = ["full_attention" if idxs is None or i in idxs else "conv" for i in range(n)]
    if len(types) != n or not set(types) <= {"conv", "full_attention"}:
        raise ValueError(f"{where}: layer_types={types} is not supported: expected num_hidden_layers={n} entries, "
                         "each 'conv' or 'full_attention'")
    return types


def whole_heads(hf: dict) -> dict:
    """config.json without partial_rotary_factor where the rope type is default: transformers' Lfm2 rotary then
    turns whole heads whatever it says (its other rope types fail on it, and llama.rope refuses it there)."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if p.get("rope_type", p.get("type", "default")) != "default":
        return hf
    drop = lambda d: {k: v for k, v in d.items() if k != "partial_rotary_factor"}
    return {**drop(hf), **{k: drop(hf[k]) for k in ("rope_scaling", "rope_parameters") if hf.get(k)}}


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of an LFM2 config.json: a layer_pattern of gated_conv and attention mixers, MLP FFNs."""
    D, H, eps = hf["hidden_size"], hf["num_attention_heads"], hf.get("norm_eps", 1e-5)
    base, scaling = rope({"rope_theta": THETA, **whole_heads(hf)}, where)
    attention = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads", 8),
                 "head_dim": hf.get("head_dim") or D // H, "rope_base": base, "long_context": "full", "qk_norm": True,
                 "norm_eps": eps}
    if scaling is not None:
        attention["rope_scaling"] = to_dict(scaling)
    gated_conv = {"kind": "gated_conv", "kernel_size": hf.get("conv_L_cache", 3), "bias": bool(hf.get("conv_bias"))}
    pattern = [gated_conv if t == "conv" else attention for t in layer_types(hf, where)]
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
            "max_seq_len": hf.get("max_position_embeddings", 128000), "layer_pattern": pattern,
            "ffn": {"kind": "mlp", "hidden_dim": ffn_width(hf)},
            "tie_embeddings": bool(hf.get("tie_embedding", hf.get("tie_word_embeddings", True))), "norm_eps": eps}


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' names: model.embed_tokens, layers (operator_norm, conv or self_attn, ffn_norm, feed_forward),
    model.embedding_norm (the final norm)."""
    D = cfg.d_model
    rows = outer_rows(cfg, norm="model.embedding_norm.weight")
    for i, m in enumerate(cfg.mixers()):
        z, p = ("blocks", i), f"model.layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "operator_norm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "ffn_norm.weight"], *same)]
        rows += [(z + ("ffn", w), [p + f"feed_forward.{n}.weight"], *linear)
                 for w, n in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))]
        if m.KIND == "gated_conv":  # in_proj's rows are b, c, h in turn
            c = p + "conv."
            rows += [(z + ("mixer", "w_in"), [c + "in_proj.weight"], *one(lambda a: a.T.reshape(D, 3, D),
                                                                          lambda w: w.reshape(D, 3 * D).T)),
                     (z + ("mixer", "conv", "weight"), [c + "conv.weight"], *conv),
                     (z + ("mixer", "out_proj", "kernel"), [c + "out_proj.weight"], *linear)]
            if m.bias:
                rows += [(z + ("mixer", "b_in"), [c + "in_proj.bias"], *one(lambda a: a.reshape(3, D),
                                                                            lambda w: w.reshape(3 * D))),
                         (z + ("mixer", "conv", "bias"), [c + "conv.bias"], *same),
                         (z + ("mixer", "out_proj", "bias"), [c + "out_proj.bias"], *same)]
            continue
        H = m.num_heads
        G, K = m.num_kv_heads or H, m.head_dim or D // H
        heads = lambda n, K=K: one(lambda a: a.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
        att = p + "self_attn."
        rows += [(z + ("mixer", "wq"), [att + "q_proj.weight"], *heads(H)),
                 (z + ("mixer", "wk"), [att + "k_proj.weight"], *heads(G)),
                 (z + ("mixer", "wv"), [att + "v_proj.weight"], *heads(G)),
                 (z + ("mixer", "wo"), [att + "out_proj.weight"], *one(lambda a, H=H, K=K: a.T.reshape(H, K, D),
                                                                       lambda w, H=H, K=K: w.reshape(H * K, D).T)),
                 (z + ("mixer", "q_norm", "weight"), [att + "q_layernorm.weight"], *same),
                 (z + ("mixer", "k_norm", "weight"), [att + "k_layernorm.weight"], *same)]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of gated_conv and attention mixers with one SwiGLU MLP width; the MLP's width is
    written as it is (block_auto_adjust_ff_dim false)."""
    mixers, ffns = cfg.mixers(), cfg.ffns()
    distinct = lambda kind: [x for i, x in enumerate(mixers) if x.KIND == kind and x not in mixers[:i]]
    convs, attns = distinct("gated_conv"), distinct("attention")
    widths = {param_shapes[("blocks", i, "ffn", "w_gate")][-1] for i, f in enumerate(ffns) if f.KIND == "mlp"}
    if len(convs) != 1 or len(attns) != 1 or {f.KIND for f in ffns} != {"mlp"} or len(widths) != 1:
        raise ValueError("zoo.hf.save: LFM2 has one gated_conv configuration, one attention configuration (at least "
                         "one attention layer: transformers' LFM2 cache fails without one) and one MLP width for every "
                         f"layer; this model has {len(convs)}, {len(attns)} and ffns {sorted({f.KIND for f in ffns})} "
                         f"of widths {sorted(widths)}")
    c, m = convs[0], attns[0]
    if (not m.qk_norm or m.qkv_bias or m.window or m.sinks or m.dilation != 1 or m.head_masks or m.output_gate
            or m.differential or m.rope_fraction != 1 or m.norm_eps != cfg.norm_eps):
        raise ValueError("zoo.hf.save: LFM2's attention has qk_norm with eps model.norm_eps and neither qkv_bias, a "
                         "window, sinks, dilation, head_masks, output_gate, differential nor rope_fraction")
    H, rope_parameters = m.num_heads, {"rope_type": "default", "rope_theta": m.rope_base}
    if m.rope_scaling is not None:
        s = to_dict(m.rope_scaling)
        rope_parameters.update(rope_type=s["type"], **{k: s[k] for k in ROPE_KEYS[s["type"]] if s[k] is not None})
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
            "layer_types": ["conv" if x.KIND == "gated_conv" else "full_attention" for x in mixers],
            "intermediate_size": widths.pop(), "block_auto_adjust_ff_dim": False, "conv_L_cache": c.kernel_size,
            "conv_bias": c.bias, "num_attention_heads": H, "num_key_value_heads": m.num_kv_heads or H,
            "head_dim": m.head_dim or cfg.d_model // H, "rope_parameters": rope_parameters,
            "norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len or 2048,
            "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
