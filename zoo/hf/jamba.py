"""Jamba (Lieber et al., 2024, arXiv 2403.19887; transformers' JambaForCausalLM): Mamba and attention
layers, each followed by a SwiGLU MLP or a mixture of SwiGLU experts.

Layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba; its FFN is the MoE
when i % expert_layer_period == expert_layer_offset (and num_experts > 1), else the MLP. In the zoo:
model.layer_pattern is one attention period (attention at the offset, mamba elsewhere) and
model.ffn_pattern one expert period (moe at the offset, mlp elsewhere), both repeated over the layers.
- Mamba: the zoo's mamba with inner_norms (Jamba's RMSNorms on Δ_low, B and C, eps rms_norm_eps);
- attention: GQA without any positional encoding (rope_fraction: 0; the Mamba layers carry the order);
- MoE: softmax router, top-k of the probabilities, not renormalised (transformers' JambaTopKRouter),
  every expert of width intermediate_size like the MLP; dropless dispatch.

`save` writes a model of that shape (one attention entry in layer_pattern, the others mamba; at most
one moe entry in ffn_pattern, the others mlp) and refuses any other by the first field its config.json
would read back differently (`refuse_unsaved`).
"""

import math

import numpy as np
from flax import nnx

from zoo.config import build_model
from zoo.hf.convert import conv, linear, one, outer_rows, refuse, same
from zoo.model import LanguageModel
from zoo.schema import to_dict

ARCHITECTURES = {"JambaForCausalLM": "jamba"}
# Fields that do not change what a loaded model computes (training-path forms, initialisation, the trained
# context's length) or that its architecture leaves unused (no rotary, no qk_norm): save writes none of them.
UNSAVED = {"model": ("dtype", "max_seq_len", "init_from"),  # and by kind
           "any": ("mode", "chunk_size", "impl", "long_context", "ring_spare"),
           "mamba": ("dt_min", "dt_max", "dt_init_floor"),
           "mamba2": ("dt_min", "dt_max", "dt_init_floor", "A_init_range"),
           "attention": ("rope_base", "rope_scaling", "norm_eps"),
           "moe": ("dispatch", "capacity_factor", "z_loss_weight", "bias_update_rate", "router_jitter")}


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Jamba config.json: layer_pattern and ffn_pattern of one period each."""
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), mamba_proj_bias=lambda v: not v,
           mamba_conv_bias=lambda v: v in (None, True))
    D, H, eps = hf["hidden_size"], hf["num_attention_heads"], hf.get("rms_norm_eps", 1e-6)
    period = {}
    for name in ("attn_layer", "expert_layer"):
        n, at = hf[f"{name}_period"], hf[f"{name}_offset"]
        if not 0 <= at < n:
            raise ValueError(f"{where}: {name}_offset={at} must lie in [0, {name}_period={n})")
        period[name] = (n, at)
    rank = hf.get("mamba_dt_rank", "auto")
    mamba = {"kind": "mamba", "state_size": hf.get("mamba_d_state", 16), "expand": hf.get("mamba_expand", 2),
             "conv_size": hf.get("mamba_d_conv", 4), "dt_rank": math.ceil(D / 16) if rank == "auto" else rank,
             "inner_norms": True, "norm_eps": eps}
    attention = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
                 "head_dim": hf.get("head_dim") or D // H, "rope_fraction": 0.0, "long_context": "full"}
    mlp = {"kind": "mlp", "hidden_dim": hf["intermediate_size"]}
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 1
    moe = {"kind": "moe", "num_experts": experts, "top_k": hf.get("num_experts_per_tok", 2),
           "hidden_dim": hf["intermediate_size"], "renormalize": False, "dispatch": "dropless",
           "balance_loss_weight": hf.get("router_aux_loss_coef", 0.001)}
    n, at = period["attn_layer"]
    layers = [attention if i == at else mamba for i in range(n)]
    n, at = period["expert_layer"] if experts > 1 else (1, -1)
    ffns = [moe if i == at else mlp for i in range(n)]
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
            "max_seq_len": hf.get("max_position_embeddings"), "layer_pattern": layers, "ffn_pattern": ffns,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": eps}


def attention_rows(z: tuple, p: str, m, D: int) -> list[tuple]:
    """The rows of an attention mixer without biases or norms (zoo path z + ("wq",), ..., z the mixer's path;
    checkpoint names p + "q_proj.weight", ...), as transformers' q/k/v/o_proj."""
    H, G = m.num_heads, m.num_kv_heads or m.num_heads
    K = m.head_dim or D // H
    heads = lambda n: one(lambda a: a.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
    return [(z + ("wq",), [p + "q_proj.weight"], *heads(H)),
            (z + ("wk",), [p + "k_proj.weight"], *heads(G)),
            (z + ("wv",), [p + "v_proj.weight"], *heads(G)),
            (z + ("wo",), [p + "o_proj.weight"], *one(lambda a: a.T.reshape(H, K, D), lambda w: w.reshape(H * K, D).T))]


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' JambaForCausalLM names: model.embed_tokens, layers (mamba or self_attn, feed_forward with
    its router and experts), model.final_layernorm."""
    stacked = (lambda a: np.stack([x.T for x in a]), lambda w: [x.T for x in w])  # E x (out, in)
    rows = outer_rows(cfg, norm="model.final_layernorm.weight")
    for i, (m, f) in enumerate(zip(cfg.mixers(), cfg.ffns())):
        z, p = ("blocks", i), f"model.layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *same),
                 (z + ("ffn_norm", "weight"), [p + "pre_ff_layernorm.weight"], *same)]
        if m.KIND == "attention":
            rows += attention_rows(z + ("mixer",), p + "self_attn.", m, cfg.d_model)
        else:
            mix = p + "mamba."
            rows += [(z + ("mixer", w, "kernel"), [mix + f"{w}.weight"], *linear)
                     for w in ("in_proj", "x_proj", "dt_proj", "out_proj")]
            rows += [(z + ("mixer", "conv", "weight"), [mix + "conv1d.weight"], *conv),
                     (z + ("mixer", "conv", "bias"), [mix + "conv1d.bias"], *same),
                     (z + ("mixer", "dt_bias"), [mix + "dt_proj.bias"], *same)]
            rows += [(z + ("mixer", n), [mix + n], *same) for n in ("A_log", "D")]
            rows += [(z + ("mixer", f"{n}_norm", "weight"), [mix + f"{n}_layernorm.weight"], *same)
                     for n in ("dt", "b", "c")]
        ffn = p + "feed_forward."
        names = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
        if f.KIND == "mlp":
            rows += [(z + ("ffn", w), [ffn + f"{n}.weight"], *linear) for w, n in names]
        else:
            rows.append((z + ("ffn", "w_router"), [ffn + "router.weight"], *linear))
            rows += [(z + ("ffn", w), [f"{ffn}experts.{e}.{n}.weight" for e in range(f.num_experts)], *stacked)
                     for w, n in names]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a Jamba-shaped model (module docstring)."""
    layers, ffns = cfg.layer_pattern or (cfg.mixer,), cfg.ffn_pattern or (cfg.ffn,)
    attn = [i for i, m in enumerate(layers) if m.KIND == "attention"]
    moe = [i for i, f in enumerate(ffns) if f.KIND == "moe"]
    if len(attn) != 1 or len(moe) > 1 or {m.KIND for m in layers} - {"attention", "mamba"} or \
            {f.KIND for f in ffns} - {"mlp", "moe"} or any(getattr(f, "activation", None) != "swiglu" for f in ffns):
        raise ValueError("zoo.hf.save: Jamba's model.layer_pattern is one attention period (one attention entry, "
                         "the others mamba) and its model.ffn_pattern one expert period (at most one moe entry, the "
                         f"others mlp, all SwiGLU); this model has layers {[m.KIND for m in layers]} and FFNs "
                         f"{[(f.KIND, getattr(f, 'activation', None)) for f in ffns]}")
    a = layers[attn[0]]
    m = next((m for m in layers if m.KIND == "mamba"), None)
    first = lambda kind: next(i for i, f in enumerate(cfg.ffns()) if f.KIND == kind)  # a layer of that FFN
    kind = "mlp" if any(f.KIND == "mlp" for f in cfg.ffns()) else "moe"
    out = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_attention_heads": a.num_heads,
           "num_key_value_heads": a.num_kv_heads or a.num_heads, "head_dim": a.head_dim or cfg.d_model // a.num_heads,
           "intermediate_size": param_shapes[("blocks", first(kind), "ffn", "w_gate")][-1],
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len or 262144,
           "tie_word_embeddings": cfg.tie_embeddings, "attn_layer_period": len(layers), "attn_layer_offset": attn[0],
           "expert_layer_period": len(ffns) if moe else 1, "expert_layer_offset": moe[0] if moe else 0,
           "num_experts": ffns[moe[0]].num_experts if moe else 1, "mamba_proj_bias": False, "mamba_conv_bias": True,
           "torch_dtype": "float32"}
    if moe:
        f = ffns[moe[0]]
        out.update(num_experts_per_tok=f.top_k, router_aux_loss_coef=f.balance_loss_weight)
    if m is not None:
        if m.conv_size == 0:
            raise ValueError("zoo.hf.save: Jamba's Mamba layers have their convolution (conv_size > 0)")
        out.update(mamba_d_state=m.state_size, mamba_expand=m.expand, mamba_d_conv=m.conv_size,
                   mamba_dt_rank=param_shapes[("blocks", cfg.mixers().index(m), "mixer", "dt_proj", "kernel")][0])
    refuse_unsaved(cfg, out, param_shapes, model_section)
    return out


def refuse_unsaved(cfg, out: dict, param_shapes: dict, section, unsaved: dict = UNSAVED):
    """A ValueError naming the first field (or parameter) of `cfg` that the config.json `out` reads back (through
    `section`, the module's model_section) as something else: an option the architecture has no place for. Layers
    are compared one by one (a pattern and its repetition are the same model); fields of `unsaved` (by kind, as
    UNSAVED) are skipped; a None or "auto" (a default) is checked through the parameters' shapes."""
    arch = out["architectures"][0]
    again = build_model({**section(out, arch, f"{arch} config.json"), "dtype": cfg.dtype}, f"{arch} config.json")

    def view(c):  # the model's fields, then each layer's mixer and FFN
        skip = unsaved["model"] + ("mixer", "ffn", "layer_pattern", "ffn_pattern")
        return {**{f"model.{k}": v for k, v in to_dict(c).items() if k not in skip},
                **{f"layer {i} {n}": to_dict(x) for i, (m, f) in enumerate(zip(c.mixers(), c.ffns()))
                   for n, x in (("mixer", m), ("ffn", f))}}

    def differ(mine, theirs, path: str):
        if isinstance(mine, dict) and isinstance(theirs, dict):
            skip = unsaved.get(mine["kind"], ()) + unsaved["any"] if "kind" in mine else ()
            return next((d for k in mine if k not in skip and (d := differ(mine[k], theirs.get(k),
                                                                           f"{path}.{k}" if path else k))), None)
        if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
            return next((d for i, (a, b) in enumerate(zip(mine, theirs)) if (d := differ(a, b, f"{path}[{i}]"))),
                        None)
        return None if mine == theirs or mine in (None, "auto") else (path, mine, theirs)

    found = differ(view(cfg), view(again), "")
    if found:
        path, mine, theirs = found
        raise ValueError(f"zoo.hf.save: {path}={mine!r} has no place in {arch} (its config.json reads back as "
                         f"{theirs!r})")
    shapes = nnx.eval_shape(lambda: LanguageModel(again, rngs=nnx.Rngs(0)))
    for path, v in nnx.to_flat_state(nnx.state(shapes, nnx.Param)):
        if param_shapes.get(path) != v.shape:
            raise ValueError(f"zoo.hf.save: parameter {'.'.join(map(str, path))} of shape {param_shapes.get(path)} "
                             f"has no place in {arch} (its config.json gives {v.shape})")
