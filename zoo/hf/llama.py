"""Llama-style checkpoints (transformers' names): attention + SwiGLU MLP blocks for LlamaForCausalLM
(Llama 1/2/3: rope_scaling linear, llama3, yarn, dynamic), MistralForCausalLM (window),
Qwen2ForCausalLM (qkv_bias) and Qwen3ForCausalLM (qk_norm); attention + MoE blocks for
MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (softmax, top-k, renormalised for
Mixtral and where the Qwen configs' norm_topk_prob says; dropless dispatch; Qwen2-MoE's shared expert
of its own width behind a sigmoid gate)."""

import numpy as np

from layers.rotary import RopeScaling
from zoo.hf.convert import linear, one, outer_rows, refuse, same
from zoo.schema import to_dict

DENSE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3"}
MOE = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
ARCHITECTURES = {**DENSE, **MOE}
ROPE_KEYS = {  # what each rope type reads (layers/rotary.py)
    "linear": ("factor",),
    "dynamic": ("factor",),  # and max_position_embeddings, its original context
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate")}


def rope_fraction(hf: dict, default: float = 1.0) -> float:
    """partial_rotary_factor (transformers 5: in rope_parameters): the share of each head's dims the rotary
    turns; `default` where config.json has none (the family's config class's default)."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    return float(p.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def rope(hf: dict, where: str, partial: bool = False) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from config.json: the rope_theta / rope_scaling keys of transformers 4
    or the rope_parameters of transformers 5; a partial_rotary_factor other than 1 is refused unless
    `partial` (the caller reads it with rope_fraction)."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    base = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if not partial and rope_fraction(hf) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor={rope_fraction(hf)} is not supported (rotary on the whole "
                         "head only)")
    kind = p.get("rope_type", p.get("type", "default"))
    if kind == "default":
        return base, None
    if kind not in ROPE_KEYS:
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported; expected default, "
                         f"{', '.join(ROPE_KEYS)}")
    original = p.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    factor = p.get("factor") or hf["max_position_embeddings"] / original
    extra = {k: p[k] for k in ROPE_KEYS[kind]  # the other keys this type reads
             if k not in ("factor", "original_max_position_embeddings") and p.get(k) is not None}
    return base, RopeScaling(type=kind, factor=float(factor), original_max_position_embeddings=int(original), **extra)


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Llama-style config.json: attention with MLP or MoE blocks."""
    family = ARCHITECTURES[arch]
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
           mlp_bias=lambda v: not v, use_sliding_window=lambda v: not v,
           decoder_sparse_step=lambda v: v in (None, 1), mlp_only_layers=lambda v: not v)
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    base, scaling = rope(hf, where)
    mixer = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
             "head_dim": hf.get("head_dim") or D // H, "rope_base": base, "long_context": "full",
             "window": hf.get("sliding_window") if family in ("mistral", "mixtral") else None,
             "qkv_bias": family == "qwen2" or family == "qwen2_moe" and hf.get("qkv_bias", True),
             "qk_norm": family in ("qwen3", "qwen3_moe"),
             "norm_eps": hf.get("rms_norm_eps", 1e-6)}
    if scaling is not None:
        mixer["rope_scaling"] = to_dict(scaling)
    ffn = moe_section(hf, family, shared=family == "qwen2_moe") if arch in MOE else \
        {"kind": "mlp", "hidden_dim": hf["intermediate_size"]}
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
            "max_seq_len": hf.get("max_position_embeddings"), "mixer": mixer, "ffn": ffn,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": hf.get("rms_norm_eps", 1e-6)}


def moe_section(hf: dict, family: str, shared: bool) -> dict:
    """The MoE FFN of a Mixtral, Qwen2-MoE, Qwen3-MoE or Qwen3-Next / Qwen3.5-MoE (zoo/hf/qwen3_next.py)
    config.json: softmax top-k, renormalised where norm_topk_prob says (by default but for Qwen2-MoE),
    dropless; `shared`: the gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""
    experts = hf.get("num_local_experts") or hf["num_experts"]
    ffn = {"kind": "moe", "num_experts": experts, "top_k": hf["num_experts_per_tok"],
           "hidden_dim": hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"],
           "renormalize": bool(hf.get("norm_topk_prob", family != "qwen2_moe")), "dispatch": "dropless",
           "balance_loss_weight": hf.get("router_aux_loss_coef", 0.01)}
    if shared:
        ffn.update(num_shared_experts=1, shared_hidden_dim=hf["shared_expert_intermediate_size"], shared_gate=True)
    return ffn


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' names: model.embed_tokens, layers (self_attn, mlp or the MoE's experts), model.norm."""
    D, m, f = cfg.d_model, cfg.mixer, cfg.ffn
    H, G = m.num_heads, m.num_kv_heads or m.num_heads
    K = m.head_dim or D // H
    heads = lambda n: one(lambda a: a.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
    bias = lambda n: one(lambda a: a.reshape(n, K), lambda w: w.reshape(n * K))
    rows = outer_rows(cfg)
    for i in range(cfg.num_layers):
        z, p = ("blocks", i), f"model.layers.{i}."
        att = p + "self_attn."
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "post_attention_layernorm.weight"], *same),
                 (z + ("mixer", "wq"), [att + "q_proj.weight"], *heads(H)),
                 (z + ("mixer", "wk"), [att + "k_proj.weight"], *heads(G)),
                 (z + ("mixer", "wv"), [att + "v_proj.weight"], *heads(G)),
                 (z + ("mixer", "wo"), [att + "o_proj.weight"], *one(lambda a: a.T.reshape(H, K, D),
                                                                     lambda w: w.reshape(H * K, D).T))]
        if m.qkv_bias:
            rows += [(z + ("mixer", f"b{n}"), [att + f"{n}_proj.bias"], *bias(c))
                     for n, c in (("q", H), ("k", G), ("v", G))]
        if m.qk_norm:
            rows += [(z + ("mixer", f"{n}_norm", "weight"), [att + f"{n}_norm.weight"], *same) for n in "qk"]
        rows += ffn_rows(f, ARCHITECTURES[arch], z, p)
    return rows


def ffn_rows(f, family: str, z: tuple, p: str) -> list[tuple]:
    """The rows of block z's FFN f, under checkpoint prefix p (model.layers.{i}.): an MLP, or an MoE's
    router and experts (Mixtral's names or the Qwen families') and Qwen2-MoE's / Qwen3-Next's gated
    shared expert."""
    if f.KIND == "mlp":
        return [(z + ("ffn", w), [p + f"mlp.{n}_proj.weight"], *linear)
                for w, n in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))]
    E = f.num_experts
    stacked = (lambda a: np.stack([x.T for x in a]), lambda w: [x.T for x in w])  # E x (out, in)
    if family == "mixtral":
        moe, names = p + "block_sparse_moe.", (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
    else:
        moe, names = p + "mlp.", (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    rows = [(z + ("ffn", "w_router"), [moe + "gate.weight"], *linear)]
    rows += [(z + ("ffn", w), [f"{moe}experts.{e}.{n}.weight" for e in range(E)], *stacked) for w, n in names]
    if f.num_shared_experts:  # the gated shared expert
        rows += [(z + ("ffn", "shared", w), [f"{moe}shared_expert.{n}.weight"], *linear) for w, n in names]
        rows.append((z + ("ffn", "w_shared_gate"), [moe + "shared_expert_gate.weight"], *linear))
    return rows


def softmax_router(f) -> bool:
    """Whether the MoE config `f` routes as Mixtral's and the Qwen MoEs' routers: top-k of the softmax scores
    over every expert, without DeepSeek-V3's sigmoid scores, expert groups, routed scale or correction bias."""
    return (f.router == "topk" and f.score_order == "softmax_then_topk" and f.scoring == "softmax"
            and f.num_groups == 1 and f.routed_scale == 1 and f.balance != "bias")


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of attention mixers with MLP or MoE FFNs, choosing the architecture
    from its options."""
    m, f = cfg.mixer, cfg.ffn
    shared = f.KIND == "moe" and f.num_shared_experts
    if f.KIND == "moe" and (not softmax_router(f) or f.activation != "swiglu" or shared and (
            f.num_shared_experts != 1 or not f.shared_gate or m.qk_norm)):
        raise ValueError("zoo.hf.save: an MoE saves as Mixtral / Qwen2-MoE / Qwen3-MoE only with router topk, "
                         "score_order softmax_then_topk, softmax scoring, one group, routed_scale 1, no router bias "
                         "(balance bias), SwiGLU experts and, for Qwen2-MoE, one gated shared expert")
    if m.sinks or m.dilation != 1 or m.head_masks is not None:
        raise ValueError("zoo.hf.save: attention sinks, dilation and head_masks have no Hugging Face architecture")
    if m.output_gate or m.differential or m.rope_fraction != 1:
        raise ValueError("zoo.hf.save: output_gate, differential and rope_fraction have no architecture here (Llama, "
                         "Mistral, Qwen2, Qwen3 and their MoE) to save as")
    if m.qkv_bias and (m.qk_norm or m.window or f.KIND == "moe" and not shared):
        raise ValueError("zoo.hf.save: qkv_bias (Qwen2, Qwen2-MoE) goes with neither qk_norm, a window nor an MoE "
                         "without Qwen2-MoE's shared expert")
    if f.KIND == "moe":
        arch = "Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM" if m.qk_norm else "MixtralForCausalLM"
        if arch == "MixtralForCausalLM" and not f.renormalize:
            raise ValueError("zoo.hf.save: Mixtral renormalises its top-k gates (moe.renormalize: true)")
    else:
        arch = "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else \
            "MistralForCausalLM" if m.window else "LlamaForCausalLM"
    if m.window and ARCHITECTURES[arch] not in ("mistral", "mixtral"):
        raise ValueError(f"zoo.hf.save: a sliding window has no place in {arch}")
    if m.qk_norm and m.norm_eps != cfg.norm_eps:
        raise ValueError(f"zoo.hf.save: {arch} uses one epsilon for every norm; mixer.norm_eps={m.norm_eps} and "
                         f"model.norm_eps={cfg.norm_eps} differ")
    H = m.num_heads
    out = {"architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_attention_heads": H,
           "num_key_value_heads": m.num_kv_heads or H, "head_dim": m.head_dim or cfg.d_model // H,
           "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len or 2048, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": m.rope_base, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "torch_dtype": "float32"}
    if m.rope_scaling is not None:
        s = to_dict(m.rope_scaling)
        out["rope_scaling"] = {"rope_type": s["type"], **{k: s[k] for k in ROPE_KEYS[s["type"]] if s[k] is not None}}
    if ARCHITECTURES[arch] in ("mistral", "mixtral"):
        out["sliding_window"] = m.window
    hidden = param_shapes[("blocks", 0, "ffn", "w_gate")][-1]
    if f.KIND == "mlp":
        out["intermediate_size"] = hidden
    elif arch == "MixtralForCausalLM":
        out.update(intermediate_size=hidden, num_local_experts=f.num_experts, num_experts_per_tok=f.top_k,
                   router_aux_loss_coef=f.balance_loss_weight)
    else:
        out.update(moe_intermediate_size=hidden, intermediate_size=hidden, num_experts=f.num_experts,
                   num_experts_per_tok=f.top_k, norm_topk_prob=f.renormalize, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=f.balance_loss_weight)
        if shared:
            out.update(shared_expert_intermediate_size=param_shapes[("blocks", 0, "ffn", "shared", "w_gate")][-1],
                       qkv_bias=m.qkv_bias)
    return out
