"""Hugging Face checkpoints in and out: `load(folder) -> (model, tokenizer)` and `save(model, folder)`.

A folder is what `save_pretrained` writes: config.json, model.safetensors (or shards listed in
model.safetensors.index.json) and tokenizer.json. `load` derives the zoo config from config.json,
builds the model abstractly (no weights made), then reads the checkpoint one tensor at a time
(memory-mapped, zoo/safetensors.py), casts each to `dtype` and places it on the mesh's sharding when
a mesh is given: beyond the model itself, at most one tensor is held (its mapped pages and one copy).

Architectures (config.json `architectures`), with the zoo options each needs:
- LlamaForCausalLM (Llama 1/2/3: rope_scaling linear, llama3, yarn, dynamic), MistralForCausalLM (window),
  Qwen2ForCausalLM (qkv_bias), Qwen3ForCausalLM (qk_norm): attention + SwiGLU MLP blocks;
- MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM: attention + MoE blocks (softmax,
  top-k, renormalised for Mixtral and where the Qwen configs' norm_topk_prob says; dropless
  dispatch; Qwen2-MoE's shared expert of its own width behind a sigmoid gate);
- MambaForCausalLM, Mamba2ForCausalLM: mixer-only blocks (ffn: none); Mamba-2 with its own gated
  norm (norm_before_gate: false, per group, eps layer_norm_epsilon);
- GLAForCausalLM and RWKV7ForCausalLM in the layout of flash-linear-attention's model hub
  (fla-hub/gla-*, fla-hub/rwkv7-*): GLA mixer (its short convolutions when use_short_conv) and SwiGLU
  MLP blocks; RWKV-7 time and channel mix in LayerNorm blocks (model.norm: layer, embed_norm for the
  first block's pre_norm), as fla's blocks compute them.
Anything else is refused naming the architecture and this list, and a config.json setting the zoo
cannot honour (a rope type, a bias, an activation) is refused naming the field.

Parity: logits equal transformers' (fla's for GLA and RWKV-7) to float32 rounding within the context
(tests/zoo/test_hf.py against fixtures made by tests/fixtures/hf/make_fixtures.py and
make_fla_fixtures.py). Past max_position_embeddings the
loaded attention sees every earlier token (long_context: full), as transformers does.

`save` writes the same layout back from any zoo model made only of these pieces (attention mixers
with MLP or MoE FFNs; mamba or mamba2 mixers with ffn none; gla with an MLP; rwkv7 with its channel
mix), choosing the architecture from its options; transformers (fla for GLA, RWKV-7) reads it with
the same logits (checked by the fixture scripts). The loaded model is in eval mode (model.train()
before fine-tuning).
"""

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from layers.rotary import RopeScaling
from zoo import safetensors
from zoo.config import ModelConfig, _build_model, to_dict
from zoo.model import DTYPES, LanguageModel
from zoo.tokenizer import HFTokenizer

DENSE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3"}
MOE = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
SSM = {"MambaForCausalLM": "mamba", "Mamba2ForCausalLM": "mamba2"}
FLA = {"GLAForCausalLM": "gla", "RWKV7ForCausalLM": "rwkv7"}  # flash-linear-attention's hub (fla-hub/*)
ARCHITECTURES = {**DENSE, **MOE, **SSM, **FLA}
ROPE_KEYS = {  # what each rope type reads (layers/rotary.py)
    "linear": ("factor",),
    "dynamic": ("factor",),  # and max_position_embeddings, its original context
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate")}
IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # buffers older Llama checkpoints carry; recomputed here


def read_config(folder) -> dict:
    f = Path(folder) / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: a Hugging Face model folder needs a readable config.json ({e})") from None


def architecture(hf: dict, where: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures={archs} is not supported; expected one of {', '.join(ARCHITECTURES)}")
    return archs[0]


def _rope(hf: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from config.json: the rope_theta / rope_scaling keys of transformers 4
    or the rope_parameters of transformers 5."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    base = float(p.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor={p.get('partial_rotary_factor')} is not supported (rotary on "
                         "the whole head only)")
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


def _number(v) -> float:
    """A config.json number; transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _refuse(hf: dict, where: str, **bad):
    """A ValueError naming the first config.json field whose value the zoo cannot honour."""
    for key, ok in bad.items():
        if not ok(hf.get(key)):
            raise ValueError(f"{where}: {key}={hf.get(key)!r} is not supported by the zoo's layers")


def _ssm_config(hf: dict, family: str, where: str) -> dict:
    """The model section of a Mamba or Mamba-2 config.json: mixer blocks without an FFN."""
    _refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), use_bias=lambda v: not v,
            use_conv_bias=lambda v: v in (None, True),
            time_step_limit=lambda v: v is None or [_number(x) for x in v] == [0, float("inf")])
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


def _rwkv7_config(hf: dict, where: str) -> dict:
    """The model section of a flash-linear-attention RWKV-7 config.json: LayerNorm blocks (with the
    embeddings' own norm when norm_first), RWKV-7 time mix and channel mix (intermediate_size, else
    hidden_ratio x hidden_size rounded up to 32)."""
    _refuse(hf, where, hidden_act=lambda v: v in (None, "sqrelu"), attn=lambda v: not v,
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


def _gla_config(hf: dict, where: str) -> dict:
    """The model section of a flash-linear-attention GLA config.json: GLA mixer, SwiGLU MLP blocks
    (fla's GatedMLP: intermediate_size, else 2/3 of hidden_ratio x hidden_size rounded up to 256)."""
    _refuse(hf, where, hidden_act=lambda v: v in (None, "swish", "silu"), feature_map=lambda v: v is None,
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


def model_config(hf: dict, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The zoo ModelConfig of a config.json; a field it needs and lacks is a ValueError naming it."""
    try:
        return _model_config(hf, dtype, where)
    except KeyError as e:
        raise ValueError(f"{where}: no field {e.args[0]}, which {hf.get('architectures')} needs") from None


def _model_config(hf: dict, dtype: str, where: str) -> ModelConfig:
    arch = architecture(hf, where)
    family = ARCHITECTURES[arch]
    if arch in SSM or arch in FLA:
        section = _ssm_config(hf, family, where) if arch in SSM else \
            {"gla": _gla_config, "rwkv7": _rwkv7_config}[family](hf, where)
        return _build_model({**section, "dtype": dtype}, f"{where} as model")
    _refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
            mlp_bias=lambda v: not v, use_sliding_window=lambda v: not v,
            decoder_sparse_step=lambda v: v in (None, 1), mlp_only_layers=lambda v: not v)
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    base, scaling = _rope(hf, where)
    mixer = {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
             "head_dim": hf.get("head_dim") or D // H, "rope_base": base, "long_context": "full",
             "window": hf.get("sliding_window") if family in ("mistral", "mixtral") else None,
             "qkv_bias": family == "qwen2" or family == "qwen2_moe" and hf.get("qkv_bias", True),
             "qk_norm": family in ("qwen3", "qwen3_moe"),
             "norm_eps": hf.get("rms_norm_eps", 1e-6)}
    if scaling is not None:
        mixer["rope_scaling"] = to_dict(scaling)
    if arch in MOE:
        experts = hf.get("num_local_experts") or hf["num_experts"]
        ffn = {"kind": "moe", "num_experts": experts, "top_k": hf["num_experts_per_tok"],
               "hidden_dim": hf["intermediate_size"] if family == "mixtral" else hf["moe_intermediate_size"],
               "renormalize": bool(hf.get("norm_topk_prob", family != "qwen2_moe")), "dispatch": "dropless",
               "balance_loss_weight": hf.get("router_aux_loss_coef", 0.01)}
        if family == "qwen2_moe":
            ffn.update(num_shared_experts=1, shared_hidden_dim=hf["shared_expert_intermediate_size"], shared_gate=True)
    else:
        ffn = {"kind": "mlp", "hidden_dim": hf["intermediate_size"]}
    return _build_model({
        "vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
        "max_seq_len": hf.get("max_position_embeddings"), "mixer": mixer, "ffn": ffn,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "dtype": dtype}, f"{where} as model")


one = lambda to, back: (lambda a: to(a[0]), lambda w: [back(w)])  # one checkpoint tensor <-> one parameter
same, linear = one(lambda a: a, lambda w: w), one(lambda a: a.T, lambda w: w.T)  # torch Linear: (out, in)
conv = one(lambda a: a[:, 0].T, lambda w: w.T[:, None])  # torch depthwise Conv1d (C, 1, W) <-> (W, C)


def _ssm_tensors(cfg: ModelConfig, arch: str) -> list[tuple]:
    rows = [(("embed", "embedding"), ["backbone.embeddings.weight"], *same),
            (("norm", "weight"), ["backbone.norm_f.weight"], *same)]
    if not cfg.tie_embeddings:
        rows.append((("head",), ["lm_head.weight"], *linear))
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


def _rwkv7_tensors(cfg: ModelConfig) -> list[tuple]:
    """fla's RWKV7Attention / RWKV7FeedForward names for the zoo's RWKV-7 (the official model's
    parameters under other names: x_r..x_g the token-shift mixes, k_k / k_a / r_k the removal scale,
    replacement rate and bonus, each LoRA's lora.0 / lora.2 its two matrices, lora.2's bias its base)."""
    D = cfg.d_model
    mixes = (lambda a: np.stack([x.reshape(D) for x in a]), lambda w: [x.reshape(1, 1, D) for x in w])
    rows = []
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


def _gla_tensors(cfg: ModelConfig) -> list[tuple]:
    """fla's GLABlock names: attn_norm, attn (q/k/v/g/o projections, gk_proj's two matrices, the
    output norm, the short convolutions), mlp_norm, mlp."""
    m = cfg.mixer
    projections = ("q", "k", "v", "o") + (("g",) if m.use_output_gate else ())
    norm = "g_norm_swish_gate" if m.use_output_gate else "g_norm"  # fla's fused gate norm, or its plain one
    rows = []
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


def _fla_tensors(cfg: ModelConfig, arch: str) -> list[tuple]:
    rows = [(("embed", "embedding"), ["model.embeddings.weight"], *same),
            (("norm", "weight"), ["model.norm.weight"], *same)]
    if cfg.norm == "layer":
        rows.append((("norm", "bias"), ["model.norm.bias"], *same))
    if not cfg.tie_embeddings:
        rows.append((("head",), ["lm_head.weight"], *linear))
    return rows + (_rwkv7_tensors(cfg) if ARCHITECTURES[arch] == "rwkv7" else _gla_tensors(cfg))


def _tensors(cfg: ModelConfig, arch: str) -> list[tuple]:
    """(zoo parameter path, checkpoint names, names' arrays -> the zoo array, zoo array -> the arrays)."""
    if arch in SSM:
        return _ssm_tensors(cfg, arch)
    if arch in FLA:
        return _fla_tensors(cfg, arch)
    D, m, f = cfg.d_model, cfg.mixer, cfg.ffn
    H, G = m.num_heads, m.num_kv_heads or m.num_heads
    K = m.head_dim or D // H
    heads = lambda n: one(lambda a: a.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
    bias = lambda n: one(lambda a: a.reshape(n, K), lambda w: w.reshape(n * K))
    stacked = lambda E: (lambda a: np.stack([x.T for x in a]), lambda w: [x.T for x in w])  # E x (out, in)
    rows = [(("embed", "embedding"), ["model.embed_tokens.weight"], *same),
            (("norm", "weight"), ["model.norm.weight"], *same)]
    if not cfg.tie_embeddings:
        rows.append((("head",), ["lm_head.weight"], *linear))
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
        if f.KIND == "mlp":
            rows += [(z + ("ffn", w), [p + f"mlp.{n}_proj.weight"], *linear)
                     for w, n in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))]
            continue
        E = f.num_experts
        if ARCHITECTURES[arch] == "mixtral":
            moe, names = p + "block_sparse_moe.", (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
        else:
            moe, names = p + "mlp.", (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
        rows.append((z + ("ffn", "w_router"), [moe + "gate.weight"], *linear))
        rows += [(z + ("ffn", w), [f"{moe}experts.{e}.{n}.weight" for e in range(E)], *stacked(E)) for w, n in names]
        if f.num_shared_experts:  # Qwen2-MoE's gated shared expert
            rows += [(z + ("ffn", "shared", w), [f"{moe}shared_expert.{n}.weight"], *linear) for w, n in names]
            rows.append((z + ("ffn", "w_shared_gate"), [moe + "shared_expert_gate.weight"], *linear))
    return rows


def _open_checkpoint(folder: Path) -> dict[str, safetensors.SafetensorsFile]:
    """Tensor name -> the open file that holds it (one model.safetensors, or the index's shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: safetensors.SafetensorsFile(folder / name) for name in sorted(set(weight_map.values()))}
        for name, file in weight_map.items():
            if name not in files[file].keys():
                raise ValueError(f"{folder / file}: holds no tensor {name}, which {index.name} places there")
        return {name: files[file] for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors "
                         "checkpoints are read)")
    f = safetensors.SafetensorsFile(single)
    return {name: f for name in f.keys()}


def read_params(path, cfg: ModelConfig, params, shardings=None, dtype=None):
    """`params` (an nnx.State of the model `cfg` makes, abstract or not) with every value read from the
    checkpoint in folder `path`, one tensor at a time, cast to `dtype` (default: each parameter's own)
    and placed with `shardings` (an nnx.State of NamedShardings like params) when given."""
    folder = Path(path)
    arch = architecture(read_config(folder), str(folder / "config.json"))
    checkpoint = _open_checkpoint(folder)
    flat = dict(nnx.to_flat_state(params))
    placed = {p: v.get_value() if isinstance(v, nnx.Variable) else v
              for p, v in (nnx.to_flat_state(shardings) if shardings is not None else ())}
    used = set()
    for zpath, names, to_zoo, to_hf in _tensors(cfg, arch):
        expected = [a.shape for a in to_hf(np.empty(flat[zpath].shape, np.float32))]  # no memory is touched
        arrays = []
        for name, shape in zip(names, expected):
            if name not in checkpoint:
                raise ValueError(f"{folder}: the checkpoint has no tensor {name}, which {arch} with this config.json "
                                 "needs")
            found = checkpoint[name].shape(name)
            if found != shape:
                raise ValueError(f"{checkpoint[name].path}: tensor {name} has shape {found}, but config.json implies "
                                 f"{shape}")
            arrays.append(checkpoint[name].get(name))
        used.update(names)
        value = np.asarray(to_zoo(arrays)).astype(DTYPES[dtype] if dtype else flat[zpath].dtype, copy=False)
        flat[zpath].set_value(jax.device_put(value, placed.get(zpath), may_alias=False))  # copied: the file stays free
    extra = sorted(n for n in checkpoint if n not in used and not n.endswith(IGNORED_TENSORS))
    if extra:
        raise ValueError(f"{folder}: the checkpoint holds tensors {arch} with this config.json has no place for: "
                         f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return nnx.from_flat_state(flat)


def load(path, *, dtype: str = "float32", mesh=None) -> tuple[LanguageModel, HFTokenizer | None]:
    """(model, tokenizer) from a local Hugging Face model folder; tokenizer None without tokenizer.json.
    Parameters are stored in `dtype` (float32 or bfloat16), which is also the compute dtype."""
    folder = Path(path)
    cfg = model_config(read_config(folder), dtype, str(folder / "config.json"))
    build = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(build)
    graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
    rest = jax.jit(lambda: nnx.state(build(), nnx.Not(nnx.Param)))()  # the weights are dead code: never made
    if mesh is not None:
        from zoo.sharding import state_shardings
        shardings = state_shardings(abstract, mesh)[0]
    model = nnx.merge(graphdef, read_params(folder, cfg, params, shardings if mesh is not None else None, dtype), rest)
    model.eval()
    tok = folder / "tokenizer.json"
    return model, HFTokenizer(tok) if tok.is_file() else None


def derived_model_section(model: dict) -> dict:
    """The `model` section of a run with model.init_from=FOLDER: config.json's model, with the
    section's own keys on top (mixer and ffn key by key)."""
    folder = Path(model["init_from"])
    derived = to_dict(model_config(read_config(folder), model.get("dtype", "float32"), str(folder / "config.json")))
    out = {**derived, **{k: v for k, v in model.items() if k not in ("mixer", "ffn")}}
    for key in ("mixer", "ffn"):
        out[key] = {**derived[key], **(model.get(key) or {})}
    return out


def _ssm_hf_config(cfg: ModelConfig) -> dict:
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


def _rwkv7_hf_config(cfg: ModelConfig, param_shapes: dict) -> dict:
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


def _gla_hf_config(cfg: ModelConfig, param_shapes: dict) -> dict:
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


def hf_config(cfg: ModelConfig, param_shapes: dict) -> dict:
    """The config.json of a zoo model `save` can write; a ValueError naming what it cannot."""
    m, f = cfg.mixer, cfg.ffn
    if cfg.exits is not None or cfg.head != "lm":
        raise ValueError("zoo.hf.save: early exits and model.head other than lm have no transformers equivalent")
    if (cfg.norm, cfg.embed_norm) != ("rms", False) and m.KIND != "rwkv7":
        raise ValueError("zoo.hf.save: LayerNorm blocks (model.norm: layer) and model.embed_norm have a Hugging Face "
                         "form only in fla's RWKV-7 layout")
    if not cfg.layer_pattern and m.KIND in ("mamba", "mamba2") and f.KIND == "none":
        return _ssm_hf_config(cfg)
    if not cfg.layer_pattern and m.KIND == "gla" and f.KIND == "mlp":
        return _gla_hf_config(cfg, param_shapes)
    if not cfg.layer_pattern and m.KIND == "rwkv7" and f.KIND == "rwkv7_channel_mix":
        return _rwkv7_hf_config(cfg, param_shapes)
    if cfg.layer_pattern or m.KIND != "attention" or f.KIND not in ("mlp", "moe"):
        raise ValueError("zoo.hf.save: only attention mixers with mlp or moe FFNs, mamba / mamba2 mixers with ffn "
                         "none, gla with mlp or rwkv7 with its channel mix (fla's layouts) have a Hugging Face "
                         "architecture; this model has mixers "
                         f"{sorted({x.KIND for x in cfg.mixers()})} and ffn {f.KIND}")
    shared = f.KIND == "moe" and f.num_shared_experts
    if f.KIND == "moe" and (f.router != "topk" or f.score_order != "softmax_then_topk" or shared and (
            f.num_shared_experts != 1 or not f.shared_gate or m.qk_norm)):
        raise ValueError("zoo.hf.save: an MoE saves as Mixtral / Qwen2-MoE / Qwen3-MoE only with router topk, "
                         "score_order softmax_then_topk and, for Qwen2-MoE, one gated shared expert")
    if m.sinks or m.dilation != 1 or m.head_masks is not None:
        raise ValueError("zoo.hf.save: attention sinks, dilation and head_masks have no Hugging Face architecture")
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


def save(model: LanguageModel, path, tokenizer: HFTokenizer | None = None):
    """Write `model` as a Hugging Face folder (config.json, model.safetensors in float32, and the
    tokenizer's tokenizer.json when given) that `load` and transformers read with the same logits."""
    flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    config = hf_config(model.cfg, {p: v.shape for p, v in flat.items()})
    arch = config["architectures"][0]
    tensors = {}
    for zpath, names, _, to_hf in _tensors(model.cfg, arch):
        value = np.asarray(jax.device_get(flat[zpath][...]), np.float32)
        tensors.update(zip(names, (np.ascontiguousarray(a) for a in to_hf(value))))
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.write(folder / "model.safetensors", tensors, {"format": "pt"})
    if tokenizer is not None:
        tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
        if tokenizer.eos_id is not None:
            config["eos_token_id"] = tokenizer.eos_id
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


__all__ = ["load", "save", "model_config", "read_config", "ARCHITECTURES"]
