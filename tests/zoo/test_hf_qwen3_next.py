"""zoo.hf on Qwen3-Next and Qwen3.5 (zoo/hf/qwen3_next.py), beyond the logits and greedy tokens and the prefill +
decode that test_hf.py checks on every fixture: save then load is the identity (Qwen3-Next's fused DeltaNet
projections and Qwen3.5's; a multimodal Qwen3.5 folder's text model), layer_types and full_attention_interval
become the layer pattern, a multimodal folder is its text model, and every config.json field the zoo cannot honour
is refused by name."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import zoo
import zoo.hf
from tests.util import HF_FIXTURES as FIXTURES
from tests.util import hf_fixture
from zoo import safetensors

config_of = lambda case: json.loads((FIXTURES / case / "config.json").read_text())
CONFIG = config_of("qwen3_next")
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")  # x̂ (1 + w)
TEXT_MODEL = "model.language_model."  # a multimodal folder's text model's tensors; its vision tower's: model.visual.
same_state = lambda a, b: all(np.array_equal(x, y) for x, y in zip(*(jax.tree.leaves(nnx.state(m)) for m in (a, b)),
                                                                  strict=True))


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5", "qwen3_5_vl"])
def test_save_then_load_is_the_identity(case, tmp_path):
    """save(load(folder)) writes the folder's tensors bit for bit, but for the zero-centred norm weights w,
    whose 1 + w (what transformers and the zoo compute with) is bit for bit the same; loading it back gives
    the same model (config and state: the same logits), the multi-token-prediction weights of the released
    checkpoints (mtp.*) left aside. A multimodal folder (qwen3_5_vl) saves as its text model alone:
    Qwen3_5ForCausalLM, its tensors under model., no vision tower."""
    model, tok = zoo.hf.load(FIXTURES / case)
    saved, with_mtp = tmp_path / "saved", tmp_path / "with_mtp"
    zoo.hf.save(model, saved, tok)
    text_only = ["Qwen3_5ForCausalLM"] if case == "qwen3_5_vl" else config_of(case)["architectures"]
    assert json.loads((saved / "config.json").read_text())["architectures"] == text_only
    ours, theirs = (safetensors.SafetensorsFile(d / "model.safetensors") for d in (saved, FIXTURES / case))
    names = {n.replace(TEXT_MODEL, "model."): n for n in theirs.keys() if not n.startswith("model.visual.")}
    assert sorted(ours.keys()) == sorted(names)
    for name, their_name in names.items():
        a, b = np.asarray(ours.get(name)), np.asarray(theirs.get(their_name))
        if name.endswith(ZERO_CENTRED):
            a, b = 1 + a, 1 + b  # float32: w itself keeps 2^-24 of 1 + w's rounding
        np.testing.assert_array_equal(a, b, err_msg=name)
    shutil.copytree(saved, with_mtp)
    tensors = {name: np.asarray(ours.get(name)) for name in ours.keys()}
    safetensors.write(with_mtp / "model.safetensors", {**tensors, "mtp.fc.weight": np.zeros((32, 64), np.float32)})
    again, _ = zoo.hf.load(with_mtp)
    assert again.cfg == model.cfg and same_state(model, again)


def test_a_multimodal_folder_is_its_text_model(tmp_path):
    """Qwen3.5-MoE's multimodal layout of the qwen3_5_moe fixture (qwen3_5_vl is Qwen3.5's, from transformers): its
    config in text_config, its tensors under model.language_model. beside a vision tower and an mtp head; tied in
    text_config, but not in the outer config, by which transformers ties. It loads as the text folder does."""
    folder = tmp_path / "multimodal"
    shutil.copytree(FIXTURES / "qwen3_5_moe", folder)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": {**config_of("qwen3_5_moe"), "tie_word_embeddings": True},
              "vision_config": config_of("qwen3_5_vl")["vision_config"], "image_token_id": 248056}
    (folder / "config.json").write_text(json.dumps(config))
    f = safetensors.SafetensorsFile(FIXTURES / "qwen3_5_moe" / "model.safetensors")
    tensors = {n.replace("model.", TEXT_MODEL, 1) if n.startswith("model.") else n: np.asarray(f.get(n))
               for n in f.keys()}
    extra = {"model.visual.patch_embed.proj.weight": np.zeros((4, 3, 1, 1, 1), np.float32),
             "mtp.fc.weight": np.zeros((32, 64), np.float32)}
    safetensors.write(folder / "model.safetensors", {**tensors, **extra})
    (model, _), (text, _) = zoo.hf.load(folder), zoo.hf.load(FIXTURES / "qwen3_5_moe")
    assert model.cfg == text.cfg and not model.cfg.tie_embeddings and same_state(model, text)


@pytest.mark.parametrize("changes, message", [
    (dict(text_config=None), "Qwen3_5ForConditionalGeneration needs its text model's config in text_config"),
    (dict(hidden_size=None), "text_config: no field hidden_size, which Qwen3_5ForConditionalGeneration's text model"),
    (dict(hidden_act="gelu"), "config.json text_config: hidden_act='gelu' is not supported"),
], ids=["no_text_config", "no_hidden_size", "gelu"])
def test_a_multimodal_config_is_refused_naming_the_field(changes, message):
    """text_config's own fields are refused as a text folder's, named as text_config's; the outer ones (the vision
    tower's, the image and video token ids) have no say over text (text_config: None removes it)."""
    config = config_of("qwen3_5_vl")
    text = {k: v for k, v in {**config["text_config"], **changes}.items() if v is not None}
    config = {**config, "text_config": None if "text_config" in changes else text}
    with pytest.raises(ValueError, match=message):
        zoo.hf.model_config(config)


def test_layer_types_become_the_layer_pattern():
    cfg = zoo.hf.model_config(CONFIG)
    assert [m.KIND for m in cfg.layer_pattern] == ["gated_deltanet", "attention", "gated_deltanet", "gated_deltanet"]
    gdn, att = cfg.layer_pattern[:2]
    assert (gdn.num_heads, gdn.num_v_heads, gdn.head_dim, gdn.expand_v, gdn.conv_size) == (2, 4, 8, 1.5, 3)
    assert (att.output_gate, att.qk_norm, att.rope_fraction, att.long_context) == ("channel", True, 0.5, "full")
    assert cfg.ffn.num_shared_experts == 1 and cfg.ffn.shared_gate and cfg.ffn.renormalize
    # without layer_types: every full_attention_interval-th layer is attention, the pattern its shortest period
    cfg = zoo.hf.model_config({**CONFIG, "layer_types": None, "num_hidden_layers": 6, "full_attention_interval": 3})
    assert cfg.num_layers == 6 and [m.KIND for m in cfg.layer_pattern] == ["gated_deltanet"] * 2 + ["attention"]
    no_factor = {k: v for k, v in CONFIG["rope_parameters"].items() if k != "partial_rotary_factor"}
    cfg = zoo.hf.model_config({**CONFIG, "rope_parameters": no_factor})
    assert cfg.layer_pattern[1].rope_fraction == 0.25  # transformers' default for Qwen3-Next


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] is not supported"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    (dict(num_experts=0), "num_experts=0 is not supported"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types=.* must give one of"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_scaling type 'longrope'"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "qwen3_next", **changes))


def test_save_chooses_the_architecture_and_refuses_what_none_holds():
    """MoE blocks save as Qwen3-Next (Qwen3.5-MoE's too: the same model in Qwen3-Next's layout), MLP blocks as
    Qwen3.5; zoo.hf.hf_config is the config.json zoo.hf.save writes, before any tensor."""
    shapes = {("blocks", 0, "ffn", "w_gate"): (32, 32), ("blocks", 0, "ffn", "shared", "w_gate"): (32, 48)}
    saved = zoo.hf.hf_config(zoo.hf.model_config(config_of("qwen3_5_moe")), shapes)
    assert saved["architectures"] == ["Qwen3NextForCausalLM"] and saved["norm_topk_prob"]
    cfg = zoo.load_config("configs/gated_deltanet.yaml", ["model.num_layers=1", "model.d_model=32",
                                                          "model.ffn.kind=moe"]).model
    with pytest.raises(ValueError, match="Qwen3-Next's blocks have an MoE with a softmax top-k router"):
        zoo.hf.hf_config(cfg, {})
