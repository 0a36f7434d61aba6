"""zoo.hf on Kimi Linear (tests/fixtures/hf/kimi_linear, made by make_fixtures.py; its logits and greedy tokens are
checked with every fixture in test_hf.py, as are save then load, the correction bias included, and decoding):
layer_types and mlp_layer_types as patterns, the original checkpoint's config.json layout, and what load and save
refuse, by name."""

import json

import pytest

import zoo.hf
from tests.util import HF_FIXTURES, assert_save_refuses, edited_config, hf_fixture, hf_loaded

FOLDER = HF_FIXTURES / "kimi_linear"
loaded = hf_loaded("kimi_linear")


def test_the_layer_types_become_patterns(loaded):
    cfg = loaded[0].cfg
    assert [m.KIND for m in cfg.mixers()] == ["kda", "mla", "kda", "kda"]
    assert [f.KIND for f in cfg.ffns()] == ["mlp", "moe", "moe", "moe"]
    kda, mla, moe = cfg.mixers()[0], cfg.mixers()[1], cfg.ffns()[1]
    assert (kda.num_heads, kda.head_dim, kda.conv_size, kda.gate_bias, kda.norm_eps) == (4, 8, 3, False, 1e-5)
    assert not mla.rotary and mla.q_lora_rank is None
    assert (moe.scoring, moe.num_groups, moe.top_groups, moe.routed_scale) == ("sigmoid", 2, 1, 2.5)
    assert moe.balance == "bias"


def test_the_original_checkpoint_layout_loads_the_same_model(loaded, tmp_path):
    """Moonshot's config.json: linear_attn_config (1-based layer lists, head_dim, num_heads, short_conv_kernel_size),
    first_k_dense_replace for the MLP layers, DeepSeek's spellings of the MoE fields."""
    hf = json.loads((FOLDER / "config.json").read_text())
    folder = hf_fixture(tmp_path, "kimi_linear", layer_types=None, mlp_layer_types=None, linear_head_dim=None,
                        linear_num_heads=None, linear_conv_kernel_dim=None, num_expert_group=None,
                        n_group=hf["num_expert_group"], num_experts=None, n_routed_experts=hf["num_experts"],
                        first_k_dense_replace=1,
                        linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3, 4], "head_dim": 8,
                                            "num_heads": 4, "short_conv_kernel_size": 3})
    assert zoo.hf.model_config(zoo.hf.read_config(folder)) == loaded[0].cfg


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "linear_attention"]),
     "layer_types=.* is not supported"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types=.* is not supported"),
    (dict(mla_use_nope=False), "mla_use_nope=False is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    (dict(num_shared_experts=0), "num_shared_experts=0 is not supported"),
    (dict(num_experts=None), "no field num_experts"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "kimi_linear", **changes))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["layer_pattern"][0].update(gate_bias=True), "mixers are kda \\(one config\\) and mla"),
    (lambda s: [m.update(gate_bias=True) for m in s["layer_pattern"] if m["kind"] == "kda"], "no output-gate bias"),
    (lambda s: s["layer_pattern"][1].update(rotary=True), "attention has rotary False"),
    (lambda s: s["ffn_pattern"][3].update(top_k=2), "FFNs are MoEs \\(one config\\)"),
], ids=["two kda configs", "gate bias", "mla rotary", "two moe configs"])
def test_save_refuses_what_kimi_linear_cannot_hold(loaded, tmp_path, edit, message):
    assert_save_refuses(edited_config(loaded[0].cfg, edit), message, tmp_path)
