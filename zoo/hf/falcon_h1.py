"""Falcon-H1 (TII, 2025, arXiv 2507.22448; transformers' FalconH1ForCausalLM): every layer a parallel hybrid, a
Mamba-2 mixer and attention reading the same normed input, their outputs summed, then a SwiGLU MLP:

    h = RMSNorm(x);  x = x + s_out Mamba2(s_in h) + a_out Attention(a_in h);  x = x + MLP(RMSNorm(x))

In the zoo: mixer kind parallel (zoo/parallel.py) of a mamba2 and an attention, in that order; ffn mlp.
- Mamba-2: inner width d_inner = mamba_d_ssm (null: mamba_expand x hidden_size), mamba_n_heads heads of
  mamba_d_head, mamba_n_groups groups of mamba_d_state; output norm by mamba_rms_norm: the gated RMSNorm per group
  (output_norm grouped; mamba_norm_before_gate: RMSNorm(y) SiLU(z) or RMSNorm(y SiLU(z))), or none, y SiLU(z);
  eps rms_norm_eps;
- attention: Llama's, head_dim as config.json says, rotary from rope_parameters;
- the μP multipliers, each a scale of a linear map's input or output, are folded into the weights as they are
  read (`scales`): embedding_multiplier into the embedding table; lm_head_multiplier into the final norm's
  weight (divided by embedding_multiplier when the embeddings are tied: the table, which is the head, carries
  it); attention_in_multiplier into wq, wk, wv, with key_multiplier into wk; attention_out_multiplier into wo;
  ssm_in_multiplier and ssm_multipliers (the "mup vector": z, x, B, C, dt) into in_proj's columns;
  ssm_out_multiplier into out_proj; mlp_multipliers (gate, down) into w_gate and w_down. So the loaded model
  computes transformers' function up to float32 rounding, and `save` writes the folded weights with every
  multiplier 1.0: a folder with the loaded model's logits, not the tensors it was read from.
Refused, naming the field: the biases (attention_bias, mlp_bias, projectors_bias, mamba_proj_bias) and a Mamba
convolution without one, an activation other than silu, a time_step_limit other than (0, inf) (the zoo's Mamba-2
has no Δ clamp; transformers applies it on prefill only), partial rotary, and embedding_multiplier 0 with tied
embeddings.
"""

import numpy as np

from zoo.hf.convert import linear, number, outer_rows, refuse, same
from zoo.hf.jamba import attention_rows, refuse_unsaved
from zoo.hf.llama import ROPE_KEYS, rope
from zoo.hf.nemotron_h import mamba2_rows
from zoo.schema import to_dict

ARCHITECTURES = {"FalconH1ForCausalLM": "falcon_h1"}
MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
               "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")  # and the two lists


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Falcon-H1 config.json: one parallel (mamba2, attention) mixer and an MLP per layer."""
    tied = bool(hf.get("tie_word_embeddings", False))
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
           mlp_bias=lambda v: not v, projectors_bias=lambda v: not v, mamba_proj_bias=lambda v: not v,
           mamba_conv_bias=lambda v: v in (None, True),
           time_step_limit=lambda v: v is None or [number(x) for x in v] == [0, float("inf")],
           embedding_multiplier=lambda v: not tied or v != 0)
    D, H, eps = hf["hidden_size"], hf["num_attention_heads"], hf.get("rms_norm_eps", 1e-5)
    d_ssm, expand = hf.get("mamba_d_ssm", 1024), hf.get("mamba_expand", 2)  # FalconH1Config's defaults
    inner, heads = d_ssm or expand * D, hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inner:
        raise ValueError(f"{where}: mamba_n_heads x mamba_d_head = {heads} x {head_dim} is not the Mamba width "
                         f"{inner} (mamba_d_ssm, or mamba_expand x hidden_size)")
    mamba2 = {"kind": "mamba2", "state_size": hf.get("mamba_d_state", 256), "expand": expand, "d_inner": d_ssm,
              "head_dim": head_dim, "num_groups": hf.get("mamba_n_groups", 1), "conv_size": hf.get("mamba_d_conv", 4),
              "norm_before_gate": bool(hf.get("mamba_norm_before_gate", True)),
              "output_norm": "grouped" if hf.get("mamba_rms_norm") else "none", "norm_eps": eps}
    base, scaling = rope(hf, where)
    attention = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
                 "head_dim": hf.get("head_dim") or D // H, "rope_base": base, "long_context": "full"}
    if scaling is not None:
        attention["rope_scaling"] = to_dict(scaling)
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
            "max_seq_len": hf.get("max_position_embeddings"),
            "mixer": {"kind": "parallel", "mixers": [mamba2, attention]},
            "ffn": {"kind": "mlp", "hidden_dim": hf["intermediate_size"]}, "tie_embeddings": tied, "norm_eps": eps}


def scales(cfg, hf: dict) -> dict:
    """Zoo parameter path -> the factor (a number, or a vector over in_proj's columns) its array is multiplied by
    as it is read: config.json's multipliers folded into the weights (module docstring)."""
    get = lambda key: 1.0 if hf.get(key) is None else float(hf[key])
    m = {key: get(key) for key in MULTIPLIERS}
    gate, down = hf.get("mlp_multipliers") or (1.0, 1.0)
    mup = hf.get("ssm_multipliers") or (1.0,) * 5
    e = m["embedding_multiplier"]
    out = {("embed", "embedding"): e,
           ("norm", "weight"): m["lm_head_multiplier"] / (e if cfg.tie_embeddings else 1.0)}
    for i, mixer in enumerate(cfg.mixers()):
        ssm = mixer.mixers[0]
        Di = ssm.d_inner or ssm.expand * cfg.d_model
        GN = ssm.num_groups * ssm.state_size
        z, parts = ("blocks", i), ("blocks", i, "mixer", "mixers")
        a_in = m["attention_in_multiplier"]
        out.update({
            parts + (0, "in_proj", "kernel"): m["ssm_in_multiplier"] * np.repeat(
                np.asarray(mup, np.float64), [Di, Di, GN, GN, Di // ssm.head_dim]),  # z, x, B, C, dt
            parts + (0, "out_proj", "kernel"): m["ssm_out_multiplier"],
            parts + (1, "wq"): a_in, parts + (1, "wk"): a_in * m["key_multiplier"], parts + (1, "wv"): a_in,
            parts + (1, "wo"): m["attention_out_multiplier"],
            z + ("ffn", "w_gate"): float(gate), z + ("ffn", "w_down"): float(down)})
    return out


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' FalconH1ForCausalLM names: model.embed_tokens, layers (input_layernorm, mamba, self_attn,
    pre_ff_layernorm, feed_forward), model.final_layernorm."""
    rows = outer_rows(cfg, norm="model.final_layernorm.weight")
    for i, mixer in enumerate(cfg.mixers()):
        z, p = ("blocks", i), f"model.layers.{i}."
        ssm, attn = mixer.mixers
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "pre_ff_layernorm.weight"], *same)]
        rows += mamba2_rows(z + ("mixer", "mixers", 0), p + "mamba.", ssm)
        rows += attention_rows(z + ("mixer", "mixers", 1), p + "self_attn.", attn, cfg.d_model)
        rows += [(z + ("ffn", w), [p + f"feed_forward.{n}_proj.weight"], *linear)
                 for w, n in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model whose every layer is a parallel of a mamba2 and an attention with an MLP, every
    multiplier 1.0 (the weights carry them)."""
    mixers, ffns = cfg.mixers(), cfg.ffns()
    if any(m.KIND != "parallel" or [p.KIND for p in m.mixers] != ["mamba2", "attention"] for m in mixers) or \
            any(f.KIND != "mlp" for f in ffns):
        raise ValueError("zoo.hf.save: Falcon-H1's layers are each a parallel of a mamba2 and an attention (in that "
                         "order) with an mlp; this model has mixers "
                         f"{[[p.KIND for p in m.mixers] if m.KIND == 'parallel' else m.KIND for m in mixers]} and "
                         f"ffns {sorted({f.KIND for f in ffns})}")
    ssm, attn = mixers[0].mixers
    if ssm.conv_size == 0:
        raise ValueError("zoo.hf.save: Falcon-H1's Mamba-2 has its convolution (conv_size > 0)")
    D, H = cfg.d_model, attn.num_heads
    Di = ssm.d_inner or ssm.expand * D
    rope_parameters = {"rope_type": "default", "rope_theta": attn.rope_base}
    if attn.rope_scaling is not None:
        s = to_dict(attn.rope_scaling)
        rope_parameters.update(rope_type=s["type"], **{k: s[k] for k in ROPE_KEYS[s["type"]] if s[k] is not None})
    out = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "vocab_size": cfg.vocab_size,
           "hidden_size": D, "num_hidden_layers": cfg.num_layers,
           "intermediate_size": param_shapes[("blocks", 0, "ffn", "w_up")][-1], "hidden_act": "silu",
           "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len or 8192,
           "tie_word_embeddings": cfg.tie_embeddings, "num_attention_heads": H,
           "num_key_value_heads": attn.num_kv_heads or H, "head_dim": attn.head_dim or D // H,
           "rope_parameters": rope_parameters, "mamba_d_ssm": Di, "mamba_expand": ssm.expand,
           "mamba_n_heads": Di // ssm.head_dim, "mamba_d_head": ssm.head_dim, "mamba_n_groups": ssm.num_groups,
           "mamba_d_state": ssm.state_size, "mamba_d_conv": ssm.conv_size, "mamba_rms_norm": ssm.output_norm != "none",
           "mamba_norm_before_gate": ssm.norm_before_gate, "mamba_conv_bias": True, "mamba_proj_bias": False,
           "projectors_bias": False, "attention_bias": False, "mlp_bias": False,
           **{key: 1.0 for key in MULTIPLIERS}, "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5,
           "torch_dtype": "float32"}
    refuse_unsaved(cfg, out, param_shapes, model_section)
    return out
