"""zoo.hf on Nemotron-H (tests/fixtures/hf/nemotron_h and nemotron_h_moe, made by make_fixtures.py; their logits
and greedy tokens are checked with every fixture in test_hf.py, as are save (which writes hybrid_override_pattern)
then load and decoding): the pattern's layers as zoo blocks, and what load and save refuse, by name."""

import pytest

import zoo.hf
from tests.util import HF_FIXTURES, assert_save_refuses, edited_config, hf_fixture, hf_loaded

loaded = hf_loaded("nemotron_h")


def test_each_mixer_layer_and_its_mlp_layer_are_one_block(loaded):
    """M-*-MM-* (8 layers): 5 blocks, an MLP where a "-" follows the mixer."""
    cfg = loaded[0].cfg
    assert [m.KIND for m in cfg.mixers()] == ["mamba2", "attention", "mamba2", "mamba2", "attention"]
    assert [f.KIND for f in cfg.ffns()] == ["mlp", "mlp", "none", "mlp", "none"]
    mamba2, attention, mlp = cfg.mixers()[0], cfg.mixers()[1], cfg.ffns()[0]
    assert (mamba2.d_inner, mamba2.head_dim, mamba2.num_groups, mamba2.norm_before_gate) == (64, 8, 2, False)
    assert (attention.rope_fraction, attention.num_kv_heads, attention.head_dim) == (0, 2, 16)
    assert (mlp.activation, mlp.hidden_dim) == ("relu2", 64)


def test_an_moe_layer_is_the_ffn_of_the_mixer_before_it():
    """M-*EME (6 layers): 3 blocks; the MoE's relu2 experts behind DeepSeek-V3's router."""
    cfg = zoo.hf.model_config(zoo.hf.read_config(HF_FIXTURES / "nemotron_h_moe"))
    assert [(m.KIND, f.KIND) for m, f in zip(cfg.mixers(), cfg.ffns())] == \
        [("mamba2", "mlp"), ("attention", "moe"), ("mamba2", "moe")]
    moe = cfg.ffns()[1]
    assert (moe.activation, moe.scoring, moe.balance, moe.num_groups, moe.top_groups, moe.renormalize) == \
        ("relu2", "sigmoid", "bias", 2, 1, True)
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, moe.shared_hidden_dim, moe.routed_scale) == (4, 2, 16, 24, 1.5)


@pytest.mark.parametrize("changes, message", [
    (dict(layers_block_type=["moe", "linear_attention"]), r"layers_block_type \(pattern 'EM'\): the MoE layer 0 "
                                                          "follows no mixer layer"),
    (dict(hybrid_override_pattern="-M*"), "the MLP layer 0 follows no mixer layer"),
    (dict(hybrid_override_pattern="M-E*"), "the MoE layer 2 follows no mixer layer"),
    (dict(moe_latent_size=8), "moe_latent_size=8 is not supported"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu' is not supported"),
    (dict(use_bias=True), "use_bias=True is not supported"),
    (dict(time_step_limit=[0.0, 0.1]), r"time_step_limit=\[0.0, 0.1\] is not supported"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1 is not supported"),
], ids=["moe_first", "mlp_first", "moe_after_mlp", "latent", "silu", "bias", "dt_limit", "mtp"])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "nemotron_h", **changes))


def _set(part: str, i: int, **changes):
    return lambda s: s[part][i].update(changes)


@pytest.mark.parametrize("edit, message", [
    (_set("ffn_pattern", 0, activation="swiglu"), "layer 0 ffn.activation='swiglu' has no place in NemotronH"),
    (_set("layer_pattern", 2, norm_before_gate=True), "layer 2 mixer.norm_before_gate=True has no place"),
    (_set("layer_pattern", 1, rope_fraction=1.0), "layer 1 mixer.rope_fraction=1.0 has no place"),
    (lambda s: s["ffn_pattern"].__setitem__(1, {"kind": "moe", "num_experts": 4, "top_k": 2}),
     "Nemotron-H's MoE has relu2 experts and a shared expert; this moe has activation 'swiglu'"),
    (lambda s: s["ffn_pattern"].__setitem__(1, {"kind": "moe", "num_experts": 4, "top_k": 2, "activation": "relu2",
                                                "num_shared_experts": 1, "balance": "bias"}),
     "layer 1 ffn.scoring='softmax' has no place in NemotronH"),
], ids=["swiglu", "norm_before_gate", "rotary", "moe_swiglu", "moe_softmax"])
def test_save_refuses_what_nemotron_h_cannot_hold(loaded, tmp_path, edit, message):
    assert_save_refuses(edited_config(loaded[0].cfg, edit), message, tmp_path)
