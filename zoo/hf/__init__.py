"""Hugging Face checkpoints in and out: `load(folder) -> (model, tokenizer)` and `save(model, folder)`.

A folder is what `save_pretrained` writes: config.json, model.safetensors (or shards listed in
model.safetensors.index.json) and tokenizer.json. `load` derives the zoo config from config.json,
builds the model abstractly (no weights made), then reads the checkpoint one tensor at a time
(memory-mapped, zoo/safetensors.py), casts each to `dtype` and places it on the mesh's sharding when
a mesh is given: beyond the model itself, at most one parameter's tensors are held (mapped pages and a copy;
an FP8 one's dequantized in `dtype`).

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
  first block's pre_norm), as fla's blocks compute them;
- Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM (text; qwen3_next.py): gated_deltanet
  (num_v_heads) and gated attention (output_gate channel, qk_norm, rope_fraction) layers by layer_types, with
  Qwen3-Next's MoE and its gated shared expert (Qwen3.5: an MLP, or the MoE always renormalised);
  zero-centred RMSNorm weights read as 1 + w; mtp.* skipped; Qwen3_5ForConditionalGeneration and
  Qwen3_5MoeForConditionalGeneration (the released multimodal folders): their text model, from text_config (and the
  outer tie_word_embeddings) and model.language_model.*, the vision tower (model.visual.*) skipped, which text ids
  never reach; save writes the text model alone (Qwen3_5ForCausalLM, or Qwen3NextForCausalLM with MoE blocks);
- DeepseekV3ForCausalLM (deepseek.py): MLA blocks, dense-then-MoE FFNs (model.ffn_pattern; sigmoid
  group-limited routing with the correction bias as the MoE's RouterBias, routed scale, ungated shared
  experts), yarn with DeepSeek's softmax mscale; KimiLinearForCausalLM (kimi_linear.py): KDA and NoPE MLA
  layers with the same MoE;
- JambaForCausalLM (jamba.py): mamba (inner_norms) and attention (rope_fraction 0) layers by
  attn_layer_period / offset, SwiGLU MLP or MoE (softmax top-k, not renormalised) by expert_layer_period /
  offset; NemotronHForCausalLM (nemotron_h.py): hybrid_override_pattern's "M" (mamba2) and "*" (attention
  without positions) layers, each with the "-" layer after it (relu2 MLP) or the "E" layer after it (Nemotron 3
  Nano's MoE: relu2 experts and shared expert, DeepSeek-V3's sigmoid group-limited router with the correction
  bias; moe_latent_size refused) as one zoo block, or ffn none;
- FalconH1ForCausalLM (falcon_h1.py): a parallel mixer of a mamba2 (d_inner, output_norm grouped or none) and an
  attention in every layer, SwiGLU MLPs; its μP multipliers folded into the weights as they are read, so save
  writes them as 1.0 (a folder with the loaded model's logits, not the tensors it was read from);
- Lfm2ForCausalLM (lfm2.py): gated_conv and attention (qk_norm) layers by layer_types, SwiGLU MLPs of the
  width transformers derives;
- RecurrentGemmaForCausalLM (recurrent_gemma.py): rglru and local attention (window, rope_fraction, out_bias)
  layers by block_types, GeGLU MLPs with biases (activation geglu, bias), the embeddings times sqrt(hidden_size)
  rounded to bfloat16 (model.embed_scale), the logits soft-capped (model.logit_softcap), (1 + w) norm weights.
Anything else is refused naming the architecture and this list, and a config.json setting the zoo
cannot honour (a rope type, a bias, an activation) is refused naming the field.

FP8 folders of any of them (quantization_config quant_method fp8, transformers' fine-grained FP8: DeepSeek-V3 /
V3.1 / R1, Kimi K2, Qwen3 FP8) are dequantized as they are read: each float8 tensor times the <name>_scale_inv of
its weight_block_size block (the last blocks ragged), to the load's dtype (convert.fp8_blocks, convert.dequantize);
other quantizations, and a scale missing or of the wrong shape, refused by name. save writes float weights.

Parity: logits equal transformers' (fla's for GLA and RWKV-7) to float32 rounding within the context
(tests/zoo/test_hf.py against fixtures made by tests/fixtures/hf/make_fixtures.py and
make_fla_fixtures.py). Past max_position_embeddings the
loaded attention sees every earlier token (long_context: full), as transformers does.

`save` writes the same layout back from any zoo model made only of these pieces (attention mixers
with MLP or MoE FFNs; mamba or mamba2 mixers with ffn none; gla with an MLP; rwkv7 with its channel
mix; the hybrids' layer and FFN patterns above; parallel mamba2 and attention with an MLP), choosing the
architecture from its options; transformers (fla for GLA, RWKV-7) reads it with the same logits (checked by the
fixture scripts; Falcon-H1's to 1e-4, its multipliers folded into the weights). The
loaded model is in eval mode (model.train() before fine-tuning).

Layout: folder.py reads and writes a folder whatever its architecture; architectures.py picks the
module of each architecture (llama.py: the Llama-style and MoE families, mamba.py, gla.py, rwkv7.py,
and the hybrids' qwen3_next.py, deepseek.py, kimi_linear.py, jamba.py, nemotron_h.py, falcon_h1.py, lfm2.py,
recurrent_gemma.py), which knows its config.json fields, its tensor names and the config.json it saves;
convert.py holds what those modules share.
"""

from zoo.hf.architectures import ARCHITECTURES, architecture, hf_config, model_config
from zoo.hf.folder import derived_model_section, load, read_config, read_params, save

__all__ = ["load", "save", "model_config", "read_config", "read_params", "derived_model_section", "hf_config",
           "architecture", "ARCHITECTURES"]
