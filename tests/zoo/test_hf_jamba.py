"""zoo.hf on Jamba (tests/fixtures/hf/jamba, made by make_fixtures.py; its logits and greedy tokens are
checked with every fixture in test_hf.py, as are save then load and decoding): the layer and FFN periods as
patterns, and what load and save refuse, by name."""

import pytest

import zoo.hf
from tests.util import assert_save_refuses, edited_config, hf_fixture, hf_loaded

loaded = hf_loaded("jamba")


def test_the_periods_become_layer_and_ffn_patterns(loaded):
    """attn_layer_period 3 offset 1 and expert_layer_period 2 offset 1 over 4 layers."""
    cfg = loaded[0].cfg
    assert [m.KIND for m in cfg.mixers()] == ["mamba", "attention", "mamba", "mamba"]
    assert [f.KIND for f in cfg.ffns()] == ["mlp", "moe", "mlp", "moe"]
    mamba, attention, moe = cfg.mixers()[0], cfg.mixers()[1], cfg.ffns()[1]
    assert mamba.inner_norms and mamba.norm_eps == 1e-5 and mamba.dt_rank == 4
    assert attention.rope_fraction == 0 and attention.num_kv_heads == 2
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (4, 2, False)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias=True is not supported"),
    (dict(mamba_conv_bias=False), "mamba_conv_bias=False is not supported"),
    (dict(attn_layer_offset=3), r"attn_layer_offset=3 must lie in \[0, attn_layer_period=3\)"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "jamba", **changes))


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["layer_pattern"][1].update(window=7), "layer 1 mixer.window=7 has no place in JambaForCausalLM"),
    (lambda s: s["layer_pattern"][1].update(rope_fraction=1.0), "layer 1 mixer.rope_fraction=1.0 has no place"),
    (lambda s: s["layer_pattern"][2].update(inner_norms=False), "layer 2 mixer.inner_norms=False has no place"),
    (lambda s: s["ffn_pattern"][1].update(renormalize=True), "layer 1 ffn.renormalize=True has no place"),
    (lambda s: s["ffn_pattern"][1].update(hidden_dim=32), "layer 1 ffn.hidden_dim=32 .* reads back as 64"),
    (lambda s: s["layer_pattern"].__setitem__(0, s["layer_pattern"][1]), "one attention period"),
], ids=["window", "rotary", "no_inner_norms", "renormalize", "expert_width", "two_attention"])
def test_save_refuses_what_jamba_cannot_hold(loaded, tmp_path, edit, message):
    assert_save_refuses(edited_config(loaded[0].cfg, edit), message, tmp_path)
