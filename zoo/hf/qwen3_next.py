"""Qwen3-Next (transformers' Qwen3NextForCausalLM): Gated DeltaNet layers ("linear_attention") and gated
softmax attention ("full_attention") as config.json's layer_types say (or every full_attention_interval-th
layer), every block with a sparse MoE and its gated shared expert (Qwen2-MoE's, zoo/hf/llama.py). Qwen3.5's
text models (Qwen3_5ForCausalLM: SwiGLU MLP blocks of intermediate_size; Qwen3_5MoeForCausalLM: Qwen3-Next's
MoE, always renormalised) are the same but for the DeltaNet's projections, stored apart (below).

What the zoo's layers take, and what is converted:
- Zero-centred RMSNorms: the block norms, the final norm and attention's q/k norms compute x̂ (1 + w) and store
  w; the zoo's RMSNorm stores 1 + w (load adds 1 in float32, as transformers computes it, so a folder's w comes
  back from save within 2^-24 and its 1 + w bit for bit; a zoo weight of 0.5 or more saves and loads back bit
  for bit). The gated norm of the Gated DeltaNet output is a plain RMSNorm (weight as stored); eps rms_norm_eps
  everywhere.
- Attention (layers/attention.py): q_proj (D -> H 2K) holds per head [query (K) | gate (K)]: wq and the
  output_gate "channel" weight w_out_gate; o <- o ⊙ σ(x W_g) before o_proj; qk_norm; the rotary on the first
  int(K partial_rotary_factor) dims of each head (rope_fraction; transformers 5's default 0.25 where config.json
  has no partial_rotary_factor), half-split as transformers; no biases (attention_bias refused).
- Gated DeltaNet (layers/deltanet.py, gated_deltanet): H = linear_num_key_heads query/key heads of K =
  linear_key_head_dim, HV = linear_num_value_heads value heads of V = linear_value_head_dim (num_v_heads;
  expand_v = V / K), each query/key head serving HV / H consecutive value heads. in_proj_qkvz (D -> 2HK + 2HV V)
  holds per query/key head [q (K) | k (K) | v (HV/H V) | z (HV/H V)], in_proj_ba (D -> 2 HV) per query/key head
  [b (HV/H) | a (HV/H)]: q_proj, k_proj, v_proj, g_proj (z, the output gate), b_proj, a_proj. Qwen3.5 stores
  in_proj_qkv ([q | k | v], heads in order), in_proj_z, in_proj_b and in_proj_a instead. conv1d (no bias,
  SiLU) runs over [q | k | v] channels: q_conv, k_conv, v_conv. beta = σ(b), log α = -exp(A_log) softplus(a +
  dt_bias), q and k L2-normalised (eps 1e-6), the query scaled by 1/√K, out = out_proj(RMSNorm(o) w ⊙ SiLU(z)).
- The MoE (layers/moe.py): softmax router, top-k renormalised where norm_topk_prob says, dropless, the shared
  expert of shared_expert_intermediate_size behind σ(x w_gate).

Refused by name: hidden_act other than silu, attention_bias, mlp_only_layers, decoder_sparse_step != 1,
num_experts 0 (Qwen3-Next's dense MLP blocks), a layer type other than the two. Past max_position_embeddings
the attention sees every earlier token (long_context: full), as transformers does. The multi-token-prediction
weights of the released checkpoints (mtp.*, which transformers skips too) are not read. Qwen3.5's multimodal
rotary (mrope_section) is the plain rotary on text, where a token's three position ids are equal.

The released Qwen3.5 folders are multimodal (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
the zoo reads their language model, which is the text model above: config.json's text_config is its config, but
for tie_word_embeddings, which transformers' multimodal model ties by the outer config's (default false); its
tensors are under model.language_model. (lm_head.weight at the top). The vision tower (model.visual.*) is skipped
as transformers' text models skip it; the vision fields (vision_config, the image and video token ids) only matter
with pixel inputs, which a text-only generate from transformers does not have either, so they are ignored: on token
ids the zoo model gives transformers' multimodal model's logits.

`save` writes a model with MoE blocks as Qwen3NextForCausalLM and one with MLP blocks as Qwen3_5ForCausalLM, a
loaded multimodal folder too (its text model, without the vision tower).
"""

import numpy as np

from zoo.hf import llama
from zoo.hf.convert import conv, linear, one, outer_rows, refuse, same
from zoo.schema import to_dict

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next", "Qwen3_5ForCausalLM": "qwen3_5_text",
                 "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5ForConditionalGeneration": "qwen3_5",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}
MULTIMODAL = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",  # -> the architecture of its text model
              "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
TYPES = {"full_attention": "attention", "linear_attention": "gated_deltanet"}
centred = one(lambda a: 1.0 + a, lambda w: w - 1.0)  # zero-centred RMSNorm weight w <-> the zoo's 1 + w


def layer_types(hf: dict, where: str) -> list[str]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4)
                                      else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - set(TYPES):
        raise ValueError(f"{where}: layer_types={types} must give one of {', '.join(TYPES)} for each of the "
                         f"num_hidden_layers={n} layers")
    return types


def text_config(hf: dict, arch: str, where: str) -> dict:
    """The config of a multimodal folder's text model: text_config, with the outer tie_word_embeddings."""
    if not isinstance(hf.get("text_config"), dict):
        raise ValueError(f"{where}: {arch} needs its text model's config in text_config, a mapping; found "
                         f"{hf.get('text_config')!r}")
    return {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", False)}


def ignored_prefixes(hf: dict) -> tuple[str, ...]:
    """The multi-token-prediction head (mtp.*) and the vision tower (model.visual.*), which transformers' Qwen3.5
    text models do not load either."""
    return ("mtp.", "model.visual.")


def model_section(hf: dict, arch: str, where: str) -> dict:
    """The model section of a Qwen3-Next or Qwen3.5 config.json: layer_pattern by layer_types (its shortest
    period), MoE or (Qwen3.5) MLP blocks; of a multimodal Qwen3.5 folder's text model."""
    if arch in MULTIMODAL:
        text, where = text_config(hf, arch, where), f"{where} text_config"
        try:
            return model_section(text, MULTIMODAL[arch], where)
        except KeyError as e:
            raise ValueError(f"{where}: no field {e.args[0]}, which {arch}'s text model needs") from None
    family = ARCHITECTURES[arch]
    refuse(hf, where, hidden_act=lambda v: v in (None, "silu"), attention_bias=lambda v: not v,
           decoder_sparse_step=lambda v: v in (None, 1), mlp_only_layers=lambda v: not v,
           num_experts=lambda v: v is None or v > 0)
    D, H, eps = hf["hidden_size"], hf["num_attention_heads"], hf.get("rms_norm_eps", 1e-6)
    base, scaling = llama.rope(hf, where, partial=True)
    attention = {"kind": "attention", "num_heads": H, "num_kv_heads": hf["num_key_value_heads"],
                 "head_dim": hf.get("head_dim") or D // H, "rope_base": base,
                 "rope_fraction": llama.rope_fraction(hf, default=0.25), "qk_norm": True, "output_gate": "channel",
                 "norm_eps": eps, "long_context": "full"}
    if scaling is not None:
        attention["rope_scaling"] = to_dict(scaling)
    Hk, Hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    K, V = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    if Hv % Hk or K * (V / K) != V:
        raise ValueError(f"{where}: linear_num_value_heads={Hv} must be a multiple of linear_num_key_heads={Hk}, and "
                         f"linear_value_head_dim={V} / linear_key_head_dim={K} exact in floating point")
    deltanet = {"kind": "gated_deltanet", "num_heads": Hk, "num_v_heads": Hv, "head_dim": K, "expand_v": V / K,
                "conv_size": hf.get("linear_conv_kernel_dim", 4), "use_output_gate": True, "norm_eps": eps}
    types = layer_types(hf, where)
    period = next(p for p in range(1, len(types) + 1)
                  if len(types) % p == 0 and types == types[:p] * (len(types) // p))
    if family == "qwen3_5_text":
        ffn = {"kind": "mlp", "hidden_dim": hf["intermediate_size"]}
    else:  # Qwen3.5-MoE's router always renormalises (its config has no norm_topk_prob)
        ffn = llama.moe_section({**hf, "norm_topk_prob": True} if family == "qwen3_5_moe_text" else hf, family,
                                shared=True)
    return {"vocab_size": hf["vocab_size"], "d_model": D, "num_layers": len(types),
            "max_seq_len": hf.get("max_position_embeddings"),
            "layer_pattern": [attention if t == "full_attention" else deltanet for t in types[:period]],
            "ffn": ffn, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "norm_eps": eps}


def attention_rows(m, D: int, z: tuple, att: str) -> list[tuple]:
    """Gated attention: q_proj's [query | gate] per head to wq and w_out_gate, the k, v, o projections, the
    zero-centred q/k norms."""
    H, G, K = m.num_heads, m.num_kv_heads or m.num_heads, m.head_dim or D // m.num_heads
    heads = lambda n: one(lambda a: a.T.reshape(D, n, K), lambda w: w.reshape(D, n * K).T)
    query_and_gate = (lambda a: np.split(a[0].T.reshape(D, H, 2 * K), 2, axis=-1),  # (D, H, K) each
                      lambda q, g: [np.concatenate([q, g], axis=-1).reshape(D, H * 2 * K).T])
    return [([z + ("mixer", "wq"), z + ("mixer", "w_out_gate")], [att + "q_proj.weight"], *query_and_gate),
            (z + ("mixer", "wk"), [att + "k_proj.weight"], *heads(G)),
            (z + ("mixer", "wv"), [att + "v_proj.weight"], *heads(G)),
            (z + ("mixer", "wo"), [att + "o_proj.weight"], *one(lambda a: a.T.reshape(H, K, D),
                                                                lambda w: w.reshape(H * K, D).T)),
            *[(z + ("mixer", f"{n}_norm", "weight"), [att + f"{n}_norm.weight"], *centred) for n in "qk"]]


def deltanet_rows(m, D: int, z: tuple, lin: str, grouped: bool) -> list[tuple]:
    """Gated DeltaNet: Qwen3-Next's fused in_proj_qkvz / in_proj_ba (`grouped` per query/key head) or Qwen3.5's
    in_proj_qkv, _z, _b, _a to the zoo's separate projections, the conv over [q | k | v] channels to its three
    convolutions, the decay, norm and out_proj."""
    H, Hv, K = m.num_heads, m.num_v_heads or m.num_heads, m.head_dim or D // m.num_heads
    r, V = Hv // H, int(K * m.expand_v)
    qkvz = [K, K, r * V, r * V]  # per query/key head

    def fused(widths):
        """A (out, D) weight holding per query/key head the pieces of `widths` <-> one (D, H * width) kernel each."""
        cuts = np.cumsum(widths)[:-1]
        return (lambda a: [w.reshape(D, -1) for w in np.split(a[0].T.reshape(D, H, -1), cuts, axis=-1)],
                lambda *ws: [np.concatenate([w.reshape(D, H, -1) for w in ws], axis=-1).reshape(D, -1).T])

    mix = lambda *names: [z + ("mixer", n, "kernel") for n in names]
    convs = [z + ("mixer", f"{n}_conv", "weight") for n in "qkv"]
    cuts = [H * K, 2 * H * K]  # in_proj_qkv's outputs and conv1d's channels: [q | k | v], heads in order
    if grouped:
        rows = [(mix("q_proj", "k_proj", "v_proj", "g_proj"), [lin + "in_proj_qkvz.weight"], *fused(qkvz)),
                (mix("b_proj", "a_proj"), [lin + "in_proj_ba.weight"], *fused([r, r]))]
    else:
        rows = [(mix("q_proj", "k_proj", "v_proj"), [lin + "in_proj_qkv.weight"],
                 lambda a: np.split(a[0].T, cuts, axis=-1), lambda *ws: [np.concatenate(ws, axis=-1).T]),
                *[(z + ("mixer", f"{n}_proj", "kernel"), [lin + f"in_proj_{c}.weight"], *linear)
                  for n, c in (("g", "z"), ("b", "b"), ("a", "a"))]]
    return [*rows,
            (convs, [lin + "conv1d.weight"], lambda a: np.split(conv[0](a), cuts, axis=-1),
             lambda *ws: conv[1](np.concatenate(ws, axis=-1))),
            (z + ("mixer", "A_log"), [lin + "A_log"], *same),
            (z + ("mixer", "dt_bias"), [lin + "dt_bias"], *same),
            (z + ("mixer", "o_norm", "weight"), [lin + "norm.weight"], *same),  # plain weight, not zero-centred
            (z + ("mixer", "o_proj", "kernel"), [lin + "out_proj.weight"], *linear)]


def tensors(cfg, arch: str) -> list[tuple]:
    """transformers' names: model.embed_tokens, layers (linear_attn or self_attn, mlp), model.norm; a multimodal
    folder's under model.language_model. (lm_head: the same)."""
    model = "model.language_model." if arch in MULTIMODAL else "model."
    arch = MULTIMODAL.get(arch, arch)
    rows = outer_rows(cfg, embed=model + "embed_tokens.weight", norm=model + "norm.weight", norm_form=centred)
    for i, (m, f) in enumerate(zip(cfg.mixers(), cfg.ffns())):
        z, p = ("blocks", i), f"{model}layers.{i}."
        rows += [(z + ("mixer_norm", "weight"), [p + "input_layernorm.weight"], *centred),
                 (z + ("ffn_norm", "weight"), [p + "post_attention_layernorm.weight"], *centred)]
        rows += attention_rows(m, cfg.d_model, z, p + "self_attn.") if m.KIND == "attention" else \
            deltanet_rows(m, cfg.d_model, z, p + "linear_attn.", grouped=arch == "Qwen3NextForCausalLM")
        rows += llama.ffn_rows(f, ARCHITECTURES[arch], z, p)
    return rows


def _one(configs, what: str):
    """The one config every layer of a kind shares (Qwen3-Next has one of each), or a ValueError."""
    if len(set(configs)) > 1:
        raise ValueError(f"zoo.hf.save: Qwen3-Next and Qwen3.5 have one {what} for every layer; this model's differ")
    return configs[0] if configs else None


def hf_config(cfg, param_shapes: dict) -> dict:
    """The config.json of a model of gated_deltanet and gated attention mixers: Qwen3NextForCausalLM with
    Qwen3-Next's MoE blocks, Qwen3_5ForCausalLM with SwiGLU MLP blocks."""
    mixers = cfg.mixers()
    if {m.KIND for m in mixers} - set(TYPES.values()):
        raise ValueError(f"zoo.hf.save: Qwen3-Next and Qwen3.5 have attention and gated_deltanet mixers only; this "
                         f"model has {sorted({m.KIND for m in mixers})}")
    att = _one([m for m in mixers if m.KIND == "attention"], "attention config")
    gdn = _one([m for m in mixers if m.KIND == "gated_deltanet"], "gated_deltanet config")
    f = _one(cfg.ffns(), "FFN")
    moe = f.KIND == "moe" and llama.softmax_router(f) and f.num_shared_experts == 1 and f.shared_gate
    if getattr(f, "activation", "swiglu") != "swiglu" or not moe and f.KIND != "mlp":
        raise ValueError("zoo.hf.save: Qwen3-Next's blocks have an MoE with a softmax top-k router "
                         "(zoo.hf.llama.softmax_router), SwiGLU experts and one gated shared expert, Qwen3.5's a "
                         "SwiGLU MLP")
    if att is not None and (not att.qk_norm or att.output_gate != "channel" or att.qkv_bias or att.window
                            or att.sinks or att.dilation != 1 or att.head_masks is not None or att.differential):
        raise ValueError("zoo.hf.save: Qwen3-Next's and Qwen3.5's attention has qk_norm, output_gate channel, and "
                         "no qkv_bias, window, sinks, dilation, head_masks or differential")
    if gdn is not None and (not gdn.use_output_gate or not gdn.conv_size):
        raise ValueError("zoo.hf.save: Qwen3-Next's and Qwen3.5's gated_deltanet has its output gate and a short "
                         "convolution")
    eps = {m.norm_eps for m in (att, gdn) if m is not None} | {cfg.norm_eps}
    if len(eps) > 1:
        raise ValueError(f"zoo.hf.save: Qwen3-Next and Qwen3.5 use one epsilon for every norm; this model's are "
                         f"{sorted(eps)}")
    D, arch = cfg.d_model, "Qwen3NextForCausalLM" if moe else "Qwen3_5ForCausalLM"
    hidden = param_shapes[("blocks", 0, "ffn", "w_gate")][-1]
    out = {"architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": cfg.vocab_size,
           "hidden_size": D, "num_hidden_layers": cfg.num_layers, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len or 2048, "rms_norm_eps": cfg.norm_eps,
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "layer_types": [{v: k for k, v in TYPES.items()}[m.KIND] for m in mixers],
           "intermediate_size": hidden, "torch_dtype": "float32"}  # MoE blocks: no MLP of intermediate_size
    if moe:
        out.update(num_experts=f.num_experts, num_experts_per_tok=f.top_k, norm_topk_prob=f.renormalize,
                   moe_intermediate_size=hidden, decoder_sparse_step=1, mlp_only_layers=[],
                   shared_expert_intermediate_size=param_shapes[("blocks", 0, "ffn", "shared", "w_gate")][-1],
                   router_aux_loss_coef=f.balance_loss_weight)
    if att is not None:
        H = att.num_heads
        out.update(num_attention_heads=H, num_key_value_heads=att.num_kv_heads or H, head_dim=att.head_dim or D // H,
                   rope_theta=att.rope_base, partial_rotary_factor=att.rope_fraction)
        if att.rope_scaling is not None:
            s = to_dict(att.rope_scaling)
            out["rope_scaling"] = {"rope_type": s["type"],
                                   **{k: s[k] for k in llama.ROPE_KEYS[s["type"]] if s[k] is not None}}
    if gdn is not None:
        K = gdn.head_dim or D // gdn.num_heads
        out.update(linear_num_key_heads=gdn.num_heads, linear_num_value_heads=gdn.num_v_heads or gdn.num_heads,
                   linear_key_head_dim=K, linear_value_head_dim=int(K * gdn.expand_v),
                   linear_conv_kernel_dim=gdn.conv_size)
    return out
