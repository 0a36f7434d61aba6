"""zoo.hf on Falcon-H1 (tests/fixtures/hf/falcon_h1 and falcon_h1_tied_nonorm, made by make_fixtures.py; their
logits and greedy tokens are checked with every fixture in test_hf.py, decoding there and in test_hf_hybrids.py):
each layer a parallel mixer of a mamba2 and an attention, the multipliers folded into the weights, so that save
writes every multiplier as 1.0 and load reads its folder back as the same model; and what load and save refuse,
by name."""

import json

import numpy as np
import pytest
from flax import nnx

import zoo.hf
from tests.util import HF_FIXTURES, assert_save_refuses, edited_config, hf_fixture, hf_loaded

loaded = hf_loaded("falcon_h1")


def test_each_layer_is_a_mamba2_beside_an_attention(loaded):
    """falcon_h1: a Mamba width of 96 (not a multiple of hidden 64) with its norm per group after the gate, GQA of
    head_dim 24; falcon_h1_tied_nonorm: the width from mamba_expand, no norm."""
    cfg = loaded[0].cfg
    assert cfg.mixer.KIND == "parallel" and cfg.ffn.KIND == "mlp" and not cfg.tie_embeddings
    ssm, attn = cfg.mixer.mixers
    assert (ssm.d_inner, ssm.head_dim, ssm.num_groups, ssm.output_norm, ssm.norm_before_gate) == \
        (96, 16, 2, "grouped", False)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rope_base) == (4, 2, 24, 5000.0)
    ssm = zoo.hf.model_config(zoo.hf.read_config(HF_FIXTURES / "falcon_h1_tied_nonorm")).mixer.mixers[0]
    assert (ssm.d_inner, ssm.expand, ssm.output_norm) == (None, 2, "none")


def test_save_writes_the_folded_weights_with_every_multiplier_one(loaded, tmp_path):
    model, tok = loaded
    zoo.hf.save(model, tmp_path, tok)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {k: v for k, v in saved.items() if "multiplier" in k} == {
        "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0, "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
        "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5}
    again, _ = zoo.hf.load(tmp_path)
    assert again.cfg == model.cfg
    state = lambda m: nnx.to_flat_state(nnx.state(m))
    for (path, a), (path2, b) in zip(state(model), state(again), strict=True):
        assert path == path2 and np.array_equal(a[...], b[...]), path


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(mlp_bias=True), "mlp_bias=True is not supported"),
    (dict(projectors_bias=True), "projectors_bias=True is not supported"),
    (dict(mamba_proj_bias=True), "mamba_proj_bias=True is not supported"),
    (dict(mamba_conv_bias=False), "mamba_conv_bias=False is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(time_step_limit=[0.0, 0.1]), r"time_step_limit=\[0.0, 0.1\] is not supported"),
    (dict(mamba_d_head=8), "mamba_n_heads x mamba_d_head = 6 x 8 is not the Mamba width 96"),
    (dict(tie_word_embeddings=True, embedding_multiplier=0), "embedding_multiplier=0 is not supported"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e3, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 is not supported"),
], ids=["attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias", "conv_bias", "gelu", "dt_limit",
        "heads", "tied_zero", "partial_rope"])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "falcon_h1", **changes))


def _parts(*parts):
    return lambda s: s["mixer"].update(mixers=[s["mixer"]["mixers"][i] for i in parts])


def _mamba2(**changes):
    return lambda s: s["mixer"]["mixers"][0].update(changes)


@pytest.mark.parametrize("edit, message", [
    (_parts(1, 0), r"a parallel of a mamba2 and an attention \(in that order\)"),
    (_parts(0), r"a parallel of a mamba2 and an attention .* this model has mixers \[\['mamba2'\], "),
    (lambda s: s.update(ffn={"kind": "mlp", "activation": "relu2"}), "ffn.activation='relu2' has no place in Falcon"),
    (_mamba2(output_norm="gated", norm_before_gate=True), r"mixer.mixers\[0\].output_norm='gated' has no place"),
    (_mamba2(conv_size=0), "Falcon-H1's Mamba-2 has its convolution"),
], ids=["order", "alone", "relu2", "whole_norm", "no_conv"])
def test_save_refuses_what_falcon_h1_cannot_hold(loaded, tmp_path, edit, message):
    assert_save_refuses(edited_config(loaded[0].cfg, edit), message, tmp_path)
