"""zoo.hf on RecurrentGemma (tests/fixtures/hf/recurrent_gemma, made by make_fixtures.py; its logits and greedy
tokens are checked with every fixture in test_hf.py, as are save then load and decoding, and test_hf_hybrids.py
runs it through int8 decoding, exits and self-speculation): config.json's fields as zoo options, the defaults of
an absent field, and what load and save refuse, by name."""

import json

import pytest

import zoo.hf
from tests.util import HF_FIXTURES, assert_save_refuses, edited_config

HF = json.loads((HF_FIXTURES / "recurrent_gemma" / "config.json").read_text())


def test_config_json_fields_and_their_defaults():
    """The fixture's fields (block_types wrapped over 3 layers, lru_width 64, MQA, rotary on half of each head of
    12, window 5, cap 4), then a config.json without the optional fields: RecurrentGemmaConfig's defaults."""
    cfg = zoo.hf.model_config(HF)
    rglru, att = cfg.mixers()[:2]
    assert [m.KIND for m in cfg.mixers()] == ["rglru", "attention", "rglru"]
    assert (rglru.lru_width, rglru.num_heads, rglru.conv_size, rglru.c) == (64, 4, 3, 8.0)
    assert (att.num_kv_heads, att.head_dim, att.rope_fraction, att.window, att.qkv_bias, att.out_bias) == \
        (1, 12, 0.5, 5, True, True)
    assert (cfg.ffn.activation, cfg.ffn.bias, cfg.ffn.hidden_dim) == ("geglu", True, 32)
    assert (cfg.embed_scale, cfg.logit_softcap, cfg.tie_embeddings) == (6.9375, 4.0, True)  # bf16(sqrt(48))
    optional = ("block_types", "lru_width", "conv1d_width", "attention_window_size", "logits_soft_cap",
                "rope_parameters", "attention_bias", "tie_word_embeddings", "num_key_value_heads", "rms_norm_eps")
    cfg = zoo.hf.model_config({k: v for k, v in HF.items() if k not in optional})
    rglru, att = cfg.mixers()[1:]
    assert [m.KIND for m in cfg.mixers()] == ["rglru", "rglru", "attention"]
    assert (rglru.lru_width, rglru.conv_size, att.num_kv_heads, att.window, att.rope_fraction, att.qkv_bias) == \
        (48, 4, 4, 2048, 0.5, False)
    assert (cfg.logit_softcap, cfg.tie_embeddings, cfg.norm_eps, att.rope_base) == (30.0, True, 1e-6, 10000.0)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    (dict(block_types=["recurrent", "mlp"]), r"block_types=\['recurrent', 'mlp'\] has \['mlp'\]"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope type 'linear' is not supported"),
], ids=["activation", "block_type", "rope_type"])
def test_unsupported_configs_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.model_config({**HF, **changes})


def _set(part: str, i: int, **changes):
    return lambda s: s[part][i].update(changes)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(logit_softcap=None), "RecurrentGemma soft-caps its logits"),
    (lambda s: s.update(embed_scale=8.0), "model.embed_scale=8.0 has no place in RecurrentGemma"),
    (lambda s: s["ffn"].update(activation="swiglu"), "layer 0 ffn.activation='swiglu' has no place"),
    (_set("layer_pattern", 0, c=4.0), "layer 0 mixer.c=4.0 has no place"),
    (_set("layer_pattern", 1, out_bias=False), "layer 1 mixer.out_bias=False has no place"),
    (_set("layer_pattern", 1, window=None), "its attention a sliding window"),
], ids=["no_cap", "scale", "swiglu", "c", "out_bias", "window"])
def test_save_refuses_what_recurrent_gemma_cannot_hold(tmp_path, edit, message):
    assert_save_refuses(edited_config(zoo.hf.model_config(HF), edit), message, tmp_path)
