"""Nemotron-H (NVIDIA, 2025, arXiv 2504.03624; transformers' NemotronHForCausalLM): a stack of pre-norm
residual layers, each one sublayer, spelled by hybrid_override_pattern (transformers 5: layers_block_type):
"M" a Mamba-2 mixer, "*" attention (GQA, no positional encoding), "-" a non-gated squared-ReLU MLP,
"E" a mixture of experts.

The zoo's block is a mixer then an FFN, each pre-norm residual: an "M" or "*" layer followed by a "-"
layer is one zoo block (mixer, mlp with activation relu2), one followed by an "E" layer a block with a moe
(Nemotron 3 Nano's), and one followed by neither a block with ffn none; model.layer_pattern and
model.ffn_pattern hold every block's, so the zoo's num_layers is the number of "M" and "*" layers. A pattern
that does not split this way ("-" or "E" first or after another FFN layer) is refused, naming the field.
- MoE: layers/moe.py with activation relu2 (experts and shared experts are non-gated squared-ReLU MLPs),
  DeepSeek-V3's router (zoo.hf.deepseek.moe_section: sigmoid scores, e_score_correction_bias as the RouterBias in
  the choice only, n_group / topk_group, norm_topk_prob, routed_scaling_factor), n_routed_experts of
  moe_intermediate_size and one shared MLP of moe_shared_expert_intermediate_size (a width of 0 or null falls
  back to intermediate_size, as in transformers, whose model reads neither n_shared_experts nor
  moe_shared_expert_overlap); moe_latent_size (experts behind a down- and up-projection of the hidden state) is
  refused by name;
- Mamba-2: the zoo's mamba2 with the official gated norm (norm_before_gate: false, per group of n_groups,
  eps layer_norm_epsilon), inner width d_inner = mamba_num_heads x mamba_head_dim (Nemotron-Nano-9B-v2's is no
  multiple of hidden_size);
- attention: rope_fraction 0 (no rotary), head_dim as config.json says;
- residual_in_fp32 is not read by transformers' blocks (the residual stays in the compute dtype), nor here.

`save` rebuilds the pattern string from the blocks and writes hybrid_override_pattern.
"""

from zoo.hf.convert import conv, linear, number, outer_rows, refuse, same
from zoo.hf.deepseek import moe_rows, moe_section
from zoo.hf.jamba import attention_rows, refuse_unsaved

ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h"}
LAYER_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}  # transformers 5's names
LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias",
          "time_step_limit": "mamba_dt_limit"}  # older config.json names, which win as in transformers
FFN_LAYERS = {"-": "MLP", "E": "MoE"}
EXPERT_NAMES = (("w_up", "up_proj"), ("w_down", "down_proj"))  # gate-less experts and shared experts


def pattern(hf: dict, where: str) -> tuple[str, str]:
    """(hybrid_override_pattern, the field named in errors): that field, or layers_block_type as its characters."""
    if hf.get("hybrid_override_pattern") is not None:
        return hf["hybrid_override_pattern"], f"{where}: hybrid_override_pattern={hf['hybrid_override_pattern']!r}"
    types = hf["layers_block_type"]
    unknown = [t for t in types if t not in LAYER_TYPES]
    if unknown:
        raise ValueError(f"{where}: layers_block_type has {unknown}; expected {', '.join(LAYER_TYPES)}")
    chars = "".join(LAYER_TYPES[t] for t in types)
    return chars, f"{where}: layers_block_type (pattern {chars!r})"


def blocks(chars: str, field: str) -> list[tuple[str, str]]:
    """The zoo blocks of a pattern: (mixer character, the FFN layer's after it: "-", "E" or ""); `field` names it
    in errors."""
    if set(chars) - set("M*-E"):
        raise ValueError(f"{field} has layers {sorted(set(chars) - set('M*-E'))}; expected M, *, - or E")
    out, i = [], 0
    while i < len(chars):
        if chars[i] in FFN_LAYERS:
            raise ValueError(f"{field}: the {FFN_LAYERS[chars[i]]} layer {i} follows no mixer layer (the zoo's block "
                             "is a mixer, then its FFN)")
        ffn = chars[i + 1:i + 2] if chars[i + 1:i + 2] in FFN_LAYERS else ""
        out.append((chars[i], ffn))
        i += 1 + len(ffn)
    return out


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Nemotron-H config.json: one zoo block per mixer layer and its MLP or MoE layer."""
    hf = {**hf, **{new: hf[old] for new, old in LEGACY.items() if old in hf}}
    refuse(hf, where, mlp_hidden_act=lambda v: v in (None, "relu2"), mamba_hidden_act=lambda v: v in (None, "silu"),
           use_bias=lambda v: not v, mamba_proj_bias=lambda v: not v, mlp_bias=lambda v: not v,
           attention_bias=lambda v: not v, use_conv_bias=lambda v: v in (None, True),
           sliding_window=lambda v: v is None, num_nextn_predict_layers=lambda v: not v,
           moe_latent_size=lambda v: v is None,
           time_step_limit=lambda v: v is None or [number(x) for x in v] == [0, float("inf")])
    D, eps = hf["hidden_size"], hf.get("layer_norm_epsilon", 1e-5)
    layers = blocks(*pattern(hf, where))
    mixers = {}
    if any(c == "M" for c, _ in layers):
        mixers["M"] = {"kind": "mamba2", "state_size": hf["ssm_state_size"], "expand": hf.get("expand", 2),
                       "d_inner": hf["mamba_num_heads"] * hf["mamba_head_dim"],
                       "head_dim": hf["mamba_head_dim"], "num_groups": hf.get("n_groups", 8),
                       "conv_size": hf.get("conv_kernel", 4), "norm_before_gate": False, "norm_eps": eps}
    if any(c == "*" for c, _ in layers):
        H = hf["num_attention_heads"]
        mixers["*"] = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
                       "head_dim": hf.get("head_dim") or D // H, "rope_fraction": 0.0, "long_context": "full"}
    ffns = {"": {"kind": "none"}}
    if any(f == "-" for _, f in layers):
        ffns["-"] = {"kind": "mlp", "hidden_dim": hf["intermediate_size"], "activation": "relu2"}
    if any(f == "E" for _, f in layers):
        ffns["E"] = {**moe_section(hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                                   hf.get("norm_topk_prob", True), hf.get("n_group"), hf.get("topk_group"),
                                   hf.get("routed_scaling_factor", 1.0), 1), "activation": "relu2",
                     "shared_hidden_dim": hf.get("moe_shared_expert_intermediate_size") or hf["intermediate_size"]}
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": len(layers),
            "max_seq_len": hf.get("max_position_embeddings"), "layer_pattern": [mixers[c] for c, _ in layers],
            "ffn_pattern": [ffns[f] for _, f in layers],
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": eps}


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' NemotronHForCausalLM names: backbone.embeddings, layers (norm, mixer: the Mamba-2 mixer, the
    attention, the MLP or the MoE), backbone.norm_f; zoo block i holds one or two of those layers."""
    rows = outer_rows(cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    j = 0  # the checkpoint's layer of block i's mixer
    for i, (m, f) in enumerate(zip(cfg.mixers(), cfg.ffns())):
        z, p = ("blocks", i), f"backbone.layers.{j}."
        mix = p + "mixer."
        rows.append((z + ("mixer_norm", "weight"), [p + "norm.weight"], *same))
        rows += attention_rows(z + ("mixer",), mix, m, cfg.d_model) if m.KIND == "attention" else \
            mamba2_rows(z + ("mixer",), mix, m)
        if f.KIND != "none":
            p = f"backbone.layers.{j + 1}."
            rows.append((z + ("ffn_norm", "weight"), [p + "norm.weight"], *same))
            rows += moe_rows(f, z, p + "mixer.", EXPERT_NAMES, EXPERT_NAMES) if f.KIND == "moe" else \
                [(z + ("ffn", w), [f"{p}mixer.{n}.weight"], *linear) for w, n in EXPERT_NAMES]
        j += 1 + (f.KIND != "none")
    return rows


def mamba2_rows(z: tuple, p: str, m) -> list[tuple]:
    """The rows of a mamba2 mixer `m` (zoo path z + ("in_proj", "kernel"), ..., z the mixer's path) under transformers'
    names of its Mamba-2 mixers (p + "in_proj.weight", ...: Nemotron-H's, Falcon-H1's), its norm's weight where it has
    one."""
    rows = [(z + (w, "kernel"), [p + f"{w}.weight"], *linear) for w in ("in_proj", "out_proj")]
    rows += [(z + ("conv", "weight"), [p + "conv1d.weight"], *conv), (z + ("conv", "bias"), [p + "conv1d.bias"], *same)]
    names = ("A_log", "D", "dt_bias") + (() if m.output_norm == "none" else ("norm.weight",))
    return rows + [(z + tuple(n.split(".")), [p + n], *same) for n in names]


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of mamba2 and attention blocks, each with a relu2 MLP, a relu2 MoE (one config)
    or no FFN."""
    mixers, ffns = cfg.mixers(), cfg.ffns()
    if {m.KIND for m in mixers} - {"mamba2", "attention"} or {f.KIND for f in ffns} - {"mlp", "moe", "none"}:
        raise ValueError("zoo.hf.save: Nemotron-H's blocks are mamba2 or attention mixers, each with a relu2 mlp, a "
                         f"relu2 moe or none; this model has mixers {sorted({m.KIND for m in mixers})} and FFNs "
                         f"{sorted({f.KIND for f in ffns})}")
    chars = "".join(("M" if m.KIND == "mamba2" else "*") + {"mlp": "-", "moe": "E", "none": ""}[f.KIND]
                    for m, f in zip(mixers, ffns))
    out = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "hybrid_override_pattern": chars, "num_hidden_layers": len(chars),
           "layer_norm_epsilon": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len or 4096,
           "tie_word_embeddings": cfg.tie_embeddings, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
           "use_bias": False, "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
           "residual_in_fp32": False, "torch_dtype": "float32"}
    m = next((m for m in mixers if m.KIND == "mamba2"), None)
    if m is not None:
        if m.conv_size == 0:
            raise ValueError("zoo.hf.save: Nemotron-H's Mamba-2 layers have their convolution (conv_size > 0)")
        out.update(ssm_state_size=m.state_size, mamba_num_heads=(m.d_inner or m.expand * cfg.d_model) // m.head_dim,
                   mamba_head_dim=m.head_dim, n_groups=m.num_groups, conv_kernel=m.conv_size, expand=m.expand)
    a = next((m for m in mixers if m.KIND == "attention"), None)
    if a is not None:
        out.update(num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads or a.num_heads,
                   head_dim=a.head_dim or cfg.d_model // a.num_heads)
    mlp = next((i for i, f in enumerate(ffns) if f.KIND == "mlp"), None)
    if mlp is not None:
        out["intermediate_size"] = param_shapes[("blocks", mlp, "ffn", "w_up")][-1]
    i = next((i for i, f in enumerate(ffns) if f.KIND == "moe"), None)
    if i is not None:
        f = ffns[i]
        if f.activation != "relu2" or f.num_shared_experts < 1:
            raise ValueError("zoo.hf.save: Nemotron-H's MoE has relu2 experts and a shared expert; this moe has "
                             f"activation {f.activation!r} and num_shared_experts {f.num_shared_experts}")
        out.update(n_routed_experts=f.num_experts, num_experts_per_tok=f.top_k,
                   moe_intermediate_size=param_shapes[("blocks", i, "ffn", "w_up")][-1],
                   moe_shared_expert_intermediate_size=param_shapes[("blocks", i, "ffn", "shared", "w_up")][-1],
                   n_shared_experts=1, n_group=f.num_groups, topk_group=f.top_groups or f.num_groups,
                   norm_topk_prob=f.renormalize, routed_scaling_factor=f.routed_scale, moe_latent_size=None)
    refuse_unsaved(cfg, out, param_shapes, model_section)
    return out
