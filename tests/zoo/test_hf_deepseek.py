"""zoo.hf on DeepSeek-V3 (tests/fixtures/hf/deepseek_v3 and deepseek_v3_q_proj, made by make_fixtures.py; their
logits and greedy tokens are checked with every fixture in test_hf.py, as are save then load, the correction bias
included, and decoding): the config as mla mixers and an FFN pattern, the correction bias as the MoE's
RouterBias, and what load and save refuse, by name."""

import numpy as np
import pytest
from flax import nnx

import zoo.hf
from layers.moe import RouterBias
from tests.util import HF_FIXTURES, assert_save_refuses, edited_config, hf_fixture, hf_loaded
from zoo import safetensors

FOLDER = HF_FIXTURES / "deepseek_v3"
loaded = hf_loaded("deepseek_v3")


def test_the_config_becomes_mla_and_dense_then_moe_ffns(loaded):
    model, _ = loaded
    cfg = model.cfg
    mla, moe = cfg.mixer, cfg.ffns()[1]
    assert [f.KIND for f in cfg.ffns()] == ["mlp", "moe", "moe"] and cfg.ffns()[0].hidden_dim == 64
    assert (mla.head_dim, mla.rope_dim, mla.v_head_dim, mla.kv_lora_rank, mla.q_lora_rank) == (12, 8, 10, 16, 24)
    assert mla.rope_scaling.type == "yarn" and mla.rope_scaling.mscale_all_dim == 0.8 and mla.norm_eps == 1e-6
    assert (moe.scoring, moe.num_groups, moe.top_groups, moe.routed_scale) == ("sigmoid", 2, 1, 2.5)
    assert moe.balance == "bias"  # the correction bias is DeepSeek-V3's loss-free balancing bias
    checkpoint = safetensors.SafetensorsFile(FOLDER / "model.safetensors")
    bias = checkpoint.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert isinstance(model.blocks[1].ffn.bias, RouterBias) and np.abs(bias).max() > 0.1
    np.testing.assert_array_equal(model.blocks[1].ffn.bias[...], bias)


def test_the_bias_needs_a_state_that_holds_it(loaded):
    """read_params fills what zoo.hf.folder.stored picks: the parameters alone lack the correction bias."""
    params = nnx.state(loaded[0], nnx.Param)
    with pytest.raises(ValueError, match=r"holds the model's blocks.1.ffn.bias, which the state to fill lacks"):
        zoo.hf.read_params(FOLDER, loaded[0].cfg, params)


@pytest.mark.parametrize("changes, message", [
    (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(rope_interleave=False), "rope_interleave=False is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_scaling type 'dynamic' is not supported with multi-head latent attention"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "deepseek_v3", **changes))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["ffn_pattern"][2].update(scoring="softmax"), "FFNs are MoEs \\(one config\\) and SwiGLU MLPs"),
    (lambda s: [f.update(scoring="softmax") for f in s["ffn_pattern"][1:]], "scoring sigmoid"),
    (lambda s: s.update(ffn_pattern=[s["ffn_pattern"][1], s["ffn_pattern"][0]]), "dense MLPs in the first layers only"),
    (lambda s: s["mixer"].update(window=8), "no window"),
], ids=["two moe configs", "softmax scores", "moe before mlp", "window"])
def test_save_refuses_what_deepseek_v3_cannot_hold(loaded, tmp_path, edit, message):
    assert_save_refuses(edited_config(loaded[0].cfg, edit), message, tmp_path)
