"""RecurrentGemma (Botev et al., 2024, arXiv 2404.07839; transformers' RecurrentGemmaForCausalLM): Griffin's
residual blocks, each a temporal block (the RG-LRU recurrent block or local attention) and a GeGLU MLP, both
pre-norm; block_types ("recurrent", "attention"), repeated over num_hidden_layers, says which temporal block.

What the zoo's layers take, and what is converted:
- Embeddings times sqrt(hidden_size) rounded to bfloat16 (transformers' `normalizer` buffer is bfloat16, so
  sqrt(2560) enters as 50.5, not 50.596): model.embed_scale; tied or not as tie_word_embeddings says.
- Logits soft-capped, cap tanh(logits / cap) with cap logits_soft_cap: model.logit_softcap.
- RMSNorms (the temporal and channel pre-norms, the final norm) compute x̂ (1 + w) and store w: the zoo's RMSNorm
  stores 1 + w (qwen3_next.centred: load adds 1 in float32 as transformers computes it, save subtracts it).
- The recurrent block: the zoo's rglru (layers/rglru.py) of width lru_width, num_attention_heads gate blocks,
  conv1d_width taps, c = 8. linear_x, linear_y, linear_out and conv_1d as they are; rg_lru's recurrence gate
  (recurrent_gate_weight (H, K, K), x W as the zoo's block-diagonal product) is gate_a, its input gate gate_x;
  recurrent_param is -Λ (a_param). transformers resets the state where position_ids is 0, the zoo at a
  document's first token: the same token in a forward pass or a generation from one prompt.
- Attention: num_attention_heads query heads of hidden_size / num_attention_heads dims (config.json's head_dim
  is not read: transformers derives it so), num_key_value_heads kv heads, the rotary on the first half of each
  head (rope_parameters' partial_rotary_factor, 0.5 where absent; rope_fraction, half-split as transformers),
  q/k/v biases when attention_bias, the output projection's bias always (out_bias), a sliding window of
  attention_window_size tokens, the query's included, as transformers' mask.
- The MLP: GeGLU (activation geglu, tanh GELU) of width intermediate_size // 2, with biases on all three
  projections (bias).

Refused by name: hidden_activation other than gelu_pytorch_tanh (the recurrent block's gate takes it too),
block_types other than recurrent / attention, a rope type other than default (transformers refuses those as
well). Not read: training-only fields (attention_dropout, w_init_variance_scale, final_w_init_variance_scale),
and max_position_embeddings, which transformers' model does not read either.

`save` writes a model of rglru and attention blocks with the MLP above and both model options; refuse_unsaved
(zoo/hf/jamba.py) names the first field the config.json would read back otherwise.
"""

import jax.numpy as jnp
import numpy as np

from zoo.hf import jamba, llama
from zoo.hf.convert import conv, linear, one, outer_rows, refuse, same
from zoo.hf.qwen3_next import centred

ARCHITECTURES = {"RecurrentGemmaForCausalLM": "recurrent_gemma"}
KINDS = {"recurrent": "rglru", "attention": "attention"}  # block_types' names -> the zoo's mixer kinds
# what save does not write: as Jamba's, but RecurrentGemma's attention has its rotary (rope_base is compared)
NOT_WRITTEN = {**jamba.UNSAVED, "attention": ("norm_eps",)}


def embed_scale(d_model: int) -> float:
    """sqrt(d_model) rounded to bfloat16, as transformers' `normalizer` buffer holds it."""
    return float(jnp.asarray(d_model ** 0.5, jnp.bfloat16).astype(jnp.float32))


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a RecurrentGemma config.json: a layer_pattern of block_types, GeGLU MLPs."""
    refuse(hf, where, hidden_activation=lambda v: v in (None, "gelu_pytorch_tanh"))
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    types = list(hf.get("block_types") or ("recurrent", "recurrent", "attention"))
    if set(types) - set(KINDS):
        raise ValueError(f"{where}: block_types={types} has {sorted(set(types) - set(KINDS))}; expected "
                         f"{' or '.join(KINDS)}")
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         "(RecurrentGemma's rotary is the default one)")
    base, _ = llama.rope(hf, where, partial=True)
    mixers = {
        "recurrent": {"kind": "rglru", "lru_width": hf.get("lru_width") or D, "num_heads": H,
                      "conv_size": hf.get("conv1d_width", 4)},
        "attention": {"kind": "attention", "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
                      "head_dim": D // H, "window": hf.get("attention_window_size", 2048), "rope_base": base,
                      "rope_fraction": llama.rope_fraction(hf, default=0.5),
                      "qkv_bias": bool(hf.get("attention_bias", False)), "out_bias": True, "long_context": "full"}}
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": hf["num_hidden_layers"],
            "layer_pattern": [mixers[t] for t in types],
            "ffn": {"kind": "mlp", "hidden_dim": hf["intermediate_size"] // 2, "activation": "geglu", "bias": True},
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)), "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "embed_scale": embed_scale(D), "logit_softcap": float(hf.get("logits_soft_cap", 30.0))}


def rglru_rows(z: tuple, p: str) -> list[tuple]:
    """The recurrent block at mixer path z: linear_x / _y / _out, conv_1d, the RG-LRU's gates, recurrent_param (-Λ)."""
    rows = [(z + (n, "kernel"), [p + f"{n}.weight"], *linear) for n in ("linear_x", "linear_y", "linear_out")]
    rows += [(z + (n, "bias"), [p + f"{n}.bias"], *same) for n in ("linear_x", "linear_y", "linear_out")]
    rows += [(z + ("conv", "weight"), [p + "conv_1d.weight"], *conv),
             (z + ("conv", "bias"), [p + "conv_1d.bias"], *same),
             (z + ("a_param",), [p + "rg_lru.recurrent_param"], *one(np.negative, np.negative))]
    for gate, name in (("gate_a", "recurrent_gate"), ("gate_x", "input_gate")):
        rows += [(z + (gate, "w"), [p + f"rg_lru.{name}_weight"], *same),
                 (z + (gate, "b"), [p + f"rg_lru.{name}_bias"], *same)]
    return rows


def attention_rows(z: tuple, p: str, m, D: int) -> list[tuple]:
    """Attention (z the mixer's path): Jamba's q/k/v/o rows, the q/k/v biases when qkv_bias, o_proj's bias."""
    H, G, K = m.num_heads, m.num_kv_heads or m.num_heads, m.head_dim or D // m.num_heads
    bias = lambda n: one(lambda a: a.reshape(n, K), lambda w: w.reshape(n * K))
    rows = jamba.attention_rows(z, p, m, D) + [(z + ("bo",), [p + "o_proj.bias"], *same)]
    if m.qkv_bias:
        rows += [(z + (f"b{n}",), [p + f"{n}_proj.bias"], *bias(c)) for n, c in (("q", H), ("k", G), ("v", G))]
    return rows


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' names: model.embed_tokens, layers (temporal_pre_norm, temporal_block, channel_pre_norm,
    mlp_block), model.final_norm."""
    rows = outer_rows(cfg, norm="model.final_norm.weight", norm_form=centred)
    for i, m in enumerate(cfg.mixers()):
        z, p = ("blocks", i), f"model.layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "temporal_pre_norm.weight"], *centred),
                 (z + ("ffn_norm", "weight"), [p + "channel_pre_norm.weight"], *centred)]
        block = p + "temporal_block."
        mix = z + ("mixer",)
        rows += rglru_rows(mix, block) if m.KIND == "rglru" else attention_rows(mix, block, m, cfg.d_model)
        rows += [(z + ("ffn", f"{w}_{n}"), [p + f"mlp_block.{n}_proj.{t}"], *(linear if w == "w" else same))
                 for n in ("gate", "up", "down") for w, t in (("w", "weight"), ("b", "bias"))]
    return rows


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of rglru and attention blocks with GeGLU MLPs (module docstring)."""
    mixers, ffns = cfg.mixers(), cfg.ffns()
    if {m.KIND for m in mixers} - set(KINDS.values()) or {f.KIND for f in ffns} != {"mlp"}:
        raise ValueError("zoo.hf.save: RecurrentGemma's blocks are rglru or attention mixers, each with an mlp; this "
                         f"model has mixers {sorted({m.KIND for m in mixers})} and FFNs "
                         f"{sorted({f.KIND for f in ffns})}")
    if cfg.logit_softcap is None:
        raise ValueError("zoo.hf.save: RecurrentGemma soft-caps its logits (model.logit_softcap); this model has none")
    period = cfg.layer_pattern or (cfg.mixer,)
    rglru = next((m for m in mixers if m.KIND == "rglru"), None)
    att = next((m for m in mixers if m.KIND == "attention"), None)
    if rglru is not None and not rglru.conv_size or att is not None and att.window is None:
        raise ValueError("zoo.hf.save: RecurrentGemma's recurrent blocks have their convolution (conv_size > 0) and "
                         "its attention a sliding window (window)")
    heads = att.num_heads if att is not None else rglru.num_heads
    out = {"architectures": ["RecurrentGemmaForCausalLM"], "model_type": "recurrent_gemma",
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": heads, "block_types": [{v: k for k, v in KINDS.items()}[m.KIND] for m in period],
           "intermediate_size": 2 * param_shapes[("blocks", 0, "ffn", "w_up")][-1],
           "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": cfg.norm_eps,
           "logits_soft_cap": cfg.logit_softcap, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32"}
    if rglru is not None:
        out.update(lru_width=rglru.lru_width or cfg.d_model, conv1d_width=rglru.conv_size)
    if att is not None:
        out.update(num_key_value_heads=att.num_kv_heads or att.num_heads, attention_window_size=att.window,
                   attention_bias=att.qkv_bias, rope_parameters={"rope_type": "default", "rope_theta": att.rope_base,
                                                                 "partial_rotary_factor": att.rope_fraction})
    jamba.refuse_unsaved(cfg, out, param_shapes, model_section, NOT_WRITTEN)
    return out
