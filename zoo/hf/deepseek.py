"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): multi-head latent attention (mla) blocks whose
first first_k_dense_replace FFNs are SwiGLU MLPs and the rest fine-grained MoEs (model.ffn_pattern).

The attention is layers/mla.py: q_a_proj / q_a_layernorm / q_b_proj (or q_proj when q_lora_rank is
null) are W_DQ / its norm / W_UQ, kv_a_proj_with_mqa is [W_DKV W_KR], kv_a_layernorm the latent's
norm (eps 1e-6, transformers' fixed one), kv_b_proj is [W_UK_h W_UV_h] per head. DeepSeek's rotary
turns interleaved pairs (2i, 2i+1) of the R rope channels (rope_interleave), the zoo's the pairs
(i, i + R/2): the same function once the rope columns of q_b_proj (q_proj) and kv_a_proj_with_mqa are
reordered evens-then-odds, which this table does (q^R . k^R is unchanged by a permutation applied to
both). yarn rope_scaling is honoured with DeepSeek's mscale_all_dim factor on the softmax scale.

The MoE is layers/moe.py with scoring sigmoid: the choice adds e_score_correction_bias (the MoE's
RouterBias, balance "bias": DeepSeek-V3's loss-free balancing bias, which the zoo's training goes on
updating) to the sigmoid scores and keeps each token's topk_group best of n_group expert groups
(num_groups, top_groups: a group scores the sum of its two best); the gates are the scores without
the bias, renormalised where norm_topk_prob, times routed_scaling_factor (routed_scale); the
n_shared_experts ungated shared experts are one MLP of n_shared_experts x moe_intermediate_size.

Refused by name: topk_method other than noaux_tc, scoring_func other than sigmoid, moe_layer_freq
other than 1, rope_interleave false, attention_bias, hidden_act other than silu, num_key_value_heads
other than num_attention_heads, n_shared_experts 0, dynamic rope. The num_nextn_predict_layers
multi-token-prediction layers (model.layers.{num_hidden_layers + k}.*) are outside the forward pass and their
tensors are not read, as in transformers. The released FP8 folders (quantization_config fp8 with
128 x 128 blocks: DeepSeek-V3, V3.1, R1, Kimi K2) are dequantized as they are read (zoo.hf.convert.fp8_blocks).
"""

import numpy as np

from zoo.hf.convert import linear, one, outer_rows, refuse, same
from zoo.hf.llama import ROPE_KEYS, rope
from zoo.schema import to_dict

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}
MLA_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep DeepseekV3RMSNorm's default
MLP_NAMES = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def ignored_prefixes(hf: dict) -> tuple[str, ...]:
    """The multi-token-prediction layers after the last, which transformers does not load either."""
    L = hf["num_hidden_layers"]
    return tuple(f"model.layers.{L + k}." for k in range(hf.get("num_nextn_predict_layers") or 0))


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a DeepSeek-V3 config.json: mla mixers, [mlp] * first_k_dense_replace + [moe] * the
    rest as model.ffn_pattern."""
    H = hf["num_attention_heads"]
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
           topk_method=lambda v: v in (None, "noaux_tc"), scoring_func=lambda v: v in (None, "sigmoid"),
           moe_layer_freq=lambda v: v in (None, 1), rope_interleave=lambda v: v in (None, True),
           num_key_value_heads=lambda v: v in (None, H), n_shared_experts=lambda v: v is None or v >= 1)
    base, scaling = rope(hf, where)
    if scaling is not None and scaling.type == "dynamic":
        raise ValueError(f"{where}: rope_scaling type 'dynamic' is not supported with multi-head latent attention")
    mixer = {"kind": "mla", "num_heads": H, "head_dim": hf["qk_nope_head_dim"], "v_head_dim": hf["v_head_dim"],
             "rope_dim": hf["qk_rope_head_dim"], "kv_lora_rank": hf["kv_lora_rank"], "q_lora_rank": hf["q_lora_rank"],
             "rope_base": base, "norm_eps": MLA_NORM_EPS, "long_context": "full"}
    if scaling is not None:
        mixer["rope_scaling"] = to_dict(scaling)
    moe = moe_section(hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                      hf.get("norm_topk_prob", True), hf["n_group"], hf["topk_group"], hf["routed_scaling_factor"],
                      hf.get("n_shared_experts", 1))
    L = hf["num_hidden_layers"]
    dense = min(hf["first_k_dense_replace"] or 0, L)
    return {"vocab_size": hf["vocab_size"], "d_model": hf["hidden_size"], "num_layers": L,
            "max_seq_len": hf.get("max_position_embeddings"), "mixer": mixer,
            "ffn_pattern": [{"kind": "mlp", "hidden_dim": hf["intermediate_size"]}] * dense + [moe] * (L - dense),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": hf.get("rms_norm_eps", 1e-6)}


def moe_section(experts: int, top_k: int, hidden: int, renormalize, groups, top_groups, scale, shared: int) -> dict:
    """The zoo MoE of DeepSeek-V3's (sigmoid scores; the correction bias, RouterBias, in the choice with balance
    "bias"; groups None: one)."""
    return {"kind": "moe", "num_experts": experts, "top_k": top_k, "hidden_dim": hidden, "scoring": "sigmoid",
            "renormalize": bool(renormalize), "num_groups": groups or 1, "top_groups": top_groups or groups or 1,
            "routed_scale": float(scale), "num_shared_experts": shared, "balance": "bias", "dispatch": "dropless"}


def mla_dims(m, d_model: int) -> tuple[int, ...]:
    """An mla config's widths (H, K, V, R, L), its defaults filled in."""
    K = m.head_dim or d_model // m.num_heads
    return m.num_heads, K, m.v_head_dim or K, m.rope_dim or K // 2, m.kv_lora_rank or 4 * K


def mla_rows(m, d_model: int, z: tuple, att: str, interleaved: bool) -> list[tuple]:
    """The rows of the mla mixer `m` at zoo path z + ("mixer",), from transformers' DeepseekV3Attention names under
    `att` (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj);
    interleaved: the checkpoint's rope channels are pairs (2i, 2i+1), taken evens first to the zoo's halves."""
    D, (H, K, V, R, L), Lq = d_model, mla_dims(m, d_model), m.q_lora_rank
    rope = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)]) if interleaved else np.arange(R)
    order, back = np.concatenate([np.arange(K), K + rope]), np.argsort(rope)  # a head's q columns; k^R's inverse
    q = lambda n_in: one(lambda a: a.T.reshape(n_in, H, K + R)[..., order],  # (H (K + R), n_in) <-> (n_in, H, K + R)
                         lambda w: w[..., np.argsort(order)].reshape(n_in, -1).T)
    kv_a = (lambda a: [a[0][:L].T, a[0][L:][rope].T], lambda wdkv, wkr: [np.concatenate([wdkv, wkr[:, back]], 1).T])
    kv_b = (lambda a: [a[0].T.reshape(L, H, K + V)[..., :K], a[0].T.reshape(L, H, K + V)[..., K:]],
            lambda wuk, wuv: [np.concatenate([wuk, wuv], -1).reshape(L, H * (K + V)).T])
    mix = z + ("mixer",)
    rows = [([mix + ("wdkv",), mix + ("wkr",)], [att + "kv_a_proj_with_mqa.weight"], *kv_a),
            (mix + ("kv_norm", "weight"), [att + "kv_a_layernorm.weight"], *same),
            ([mix + ("wuk",), mix + ("wuv",)], [att + "kv_b_proj.weight"], *kv_b),
            (mix + ("wo",), [att + "o_proj.weight"], *one(lambda a: a.T.reshape(H, V, D),
                                                          lambda w: w.reshape(H * V, D).T))]
    if Lq is None:
        return rows + [(mix + ("wuq",), [att + "q_proj.weight"], *q(D))]
    return rows + [(mix + ("wdq",), [att + "q_a_proj.weight"], *linear),
                   (mix + ("q_norm", "weight"), [att + "q_a_layernorm.weight"], *same),
                   (mix + ("wuq",), [att + "q_b_proj.weight"], *q(Lq))]


def mlp_rows(z: tuple, mlp: str) -> list[tuple]:
    """The rows of a SwiGLU MLP at zoo path z + ("ffn",) from gate_proj, up_proj, down_proj under `mlp`."""
    return [(z + ("ffn", w), [f"{mlp}{n}.weight"], *linear) for w, n in MLP_NAMES]


def moe_rows(f, z: tuple, moe: str, experts=MLP_NAMES, shared=MLP_NAMES) -> list[tuple]:
    """The rows of the MoE `f` at zoo path z + ("ffn",) from transformers' DeepseekV3MoE names under `moe`: gate
    (its weight and e_score_correction_bias: the MoE's RouterBias), experts.{e}.<the `experts` names of w_gate,
    w_up, w_down>, shared_experts.<the `shared` names> (pairs (zoo name, checkpoint name); without w_gate for
    gate-less experts)."""
    stacked = (lambda a: np.stack([x.T for x in a]), lambda w: [x.T for x in w])  # E x (out, in)
    rows = [(z + ("ffn", "w_router"), [moe + "gate.weight"], *linear),
            (z + ("ffn", "bias"), [moe + "gate.e_score_correction_bias"], *same)]
    rows += [(z + ("ffn", w), [f"{moe}experts.{e}.{n}.weight" for e in range(f.num_experts)], *stacked)
             for w, n in experts]
    return rows + [(z + ("ffn", "shared", w), [f"{moe}shared_experts.{n}.weight"], *linear) for w, n in shared]


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' DeepseekV3 names: model.embed_tokens, layers (self_attn's MLA projections, mlp: a dense
    MLP or gate / experts / shared_experts), model.norm."""
    rows = outer_rows(cfg)
    for i, f in enumerate(cfg.ffns()):
        z, p = ("blocks", i), f"model.layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "post_attention_layernorm.weight"], *same)]
        rows += mla_rows(cfg.mixer, cfg.d_model, z, p + "self_attn.", interleaved=True)
        rows += mlp_rows(z, p + "mlp.") if f.KIND == "mlp" else moe_rows(f, z, p + "mlp.")
    return rows


def checked_ffns(cfg, param_shapes: dict, arch: str) -> tuple:
    """(the MoE config, its expert width, the dense MLPs' width) of a model whose FFNs are SwiGLU MLPs (one config)
    and at least one MoE (one config) of DeepSeek-V3's kind; a ValueError naming what `arch` cannot hold."""
    ffns = cfg.ffns()
    moes, mlps = ([i for i, f in enumerate(ffns) if f.KIND == kind] for kind in ("moe", "mlp"))
    if not moes or len(moes) + len(mlps) != len(ffns) or any(ffns[i] != ffns[moes[0]] for i in moes) \
            or any(ffns[i] != ffns[mlps[0]] or ffns[i].activation != "swiglu" for i in mlps):
        raise ValueError(f"zoo.hf.save: {arch}'s FFNs are MoEs (one config) and SwiGLU MLPs (one config); this model "
                         f"has ffns {[f.KIND for f in ffns]}")
    f = ffns[moes[0]]
    if f.activation != "swiglu":
        raise ValueError(f"zoo.hf.save: {arch}'s experts are SwiGLU MLPs; this MoE's activation is {f.activation!r}")
    F = param_shapes[("blocks", moes[0], "ffn", "w_gate")][-1]
    if f.router != "topk" or f.scoring != "sigmoid" or not f.num_shared_experts or f.shared_gate \
            or param_shapes[("blocks", moes[0], "ffn", "shared", "w_gate")][-1] != f.num_shared_experts * F \
            or f.num_experts // f.num_groups < 2:
        raise ValueError(f"zoo.hf.save: {arch}'s MoE has router topk, scoring sigmoid, groups of at least two experts "
                         "and ungated shared experts of num_shared_experts x hidden_dim")
    return f, F, param_shapes[("blocks", mlps[0], "ffn", "w_gate")][-1] if mlps else F


def check_mla(m, arch: str, rotary: bool):
    """A ValueError unless the mla config `m` is `arch`'s attention (no window, latent norms of eps 1e-6, `rotary`)."""
    if m.window is not None or m.norm_eps != MLA_NORM_EPS or m.rotary != rotary:
        raise ValueError(f"zoo.hf.save: {arch}'s attention has rotary {rotary}, no window and latent norms of eps "
                         f"{MLA_NORM_EPS}; this mla has rotary {m.rotary}, window {m.window} and norm_eps {m.norm_eps}")


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of mla mixers whose FFNs are SwiGLU MLPs in the first layers and one MoE config
    (sigmoid scores, ungated shared experts) in the rest."""
    m, arch = cfg.mixer, "DeepSeek-V3"
    f, F, hidden = checked_ffns(cfg, param_shapes, arch)
    dense = next(i for i, x in enumerate(cfg.ffns()) if x.KIND == "moe")
    if cfg.layer_pattern or any(x.KIND == "mlp" for x in cfg.ffns()[dense:]):
        raise ValueError("zoo.hf.save: a DeepSeek-V3 has mla mixers (one config) and its dense MLPs in the first "
                         f"layers only; this model has mixers {sorted({x.KIND for x in cfg.mixers()})} and ffns "
                         f"{[x.KIND for x in cfg.ffns()]}")
    check_mla(m, arch, rotary=True)
    H, K, V, R, L = mla_dims(m, cfg.d_model)
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_attention_heads": H,
           "num_key_value_heads": H, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": L, "qk_nope_head_dim": K,
           "qk_rope_head_dim": R, "v_head_dim": V, "rope_interleave": True, "intermediate_size": hidden,
           "first_k_dense_replace": dense, "moe_intermediate_size": F, "n_routed_experts": f.num_experts,
           "num_experts_per_tok": f.top_k, "n_shared_experts": f.num_shared_experts, "n_group": f.num_groups,
           "topk_group": f.top_groups or f.num_groups, "norm_topk_prob": f.renormalize,
           "routed_scaling_factor": f.routed_scale, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
           "num_nextn_predict_layers": 0, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len or 2048,
           "rms_norm_eps": cfg.norm_eps, "rope_theta": m.rope_base, "tie_word_embeddings": cfg.tie_embeddings,
           "attention_bias": False, "torch_dtype": "float32"}
    if m.rope_scaling is not None:
        s = to_dict(m.rope_scaling)
        out["rope_scaling"] = {"rope_type": s["type"], **{k: s[k] for k in ROPE_KEYS[s["type"]] if s[k] is not None}}
    return out
