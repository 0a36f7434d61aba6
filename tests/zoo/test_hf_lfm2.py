"""LFM2 (zoo/hf/lfm2.py) beyond tests/zoo/test_hf.py's logits and greedy tokens, save then load and decoding on the
fixture: the older spellings of config.json load the same model, the MLP width is derived as transformers derives
it, and what the zoo cannot honour or save is refused by name."""

import pytest
from flax import nnx

import zoo
import zoo.hf
from tests.util import hf_fixture, hf_loaded
from zoo.hf.lfm2 import ffn_width

loaded = hf_loaded("lfm2")


def test_older_spellings_load_the_same_model(loaded, tmp_path):
    """full_attn_idxs instead of layer_types, block_ff_dim and tie_embedding over their newer names, the rope
    theta at the top level (transformers 4's files); partial_rotary_factor, which transformers' default LFM2 rotary
    ignores."""
    folder = hf_fixture(tmp_path, "lfm2", layer_types=None, full_attn_idxs=[1], block_ff_dim=100, intermediate_size=7,
                     tie_embedding=True, tie_word_embeddings=False, rope_parameters=None, rope_theta=5000.0,
                     partial_rotary_factor=0.5)
    assert zoo.hf.load(folder)[0].cfg == loaded[0].cfg


def test_the_mlp_width_is_derived_as_transformers_derives_it():
    assert ffn_width({"intermediate_size": 100, "block_ffn_dim_multiplier": 1.3, "block_multiple_of": 24}) == 96
    assert ffn_width({"intermediate_size": 12288}) == 8192  # LFM2-1.2B: 2/3, multiplier 1, multiple of 256
    assert ffn_width({"intermediate_size": 100, "block_ffn_dim_multiplier": None}) == 66  # no rounding without it
    assert ffn_width({"intermediate_size": 100, "block_auto_adjust_ff_dim": False}) == 100


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["conv", "sliding_attention", "conv", "conv"]), "layer_types=.* is not supported"),
    (dict(layer_types=["conv", "full_attention"]), "expected num_hidden_layers=4 entries"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0, "factor": 2.0}),
     "rope_scaling type 'longrope' is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 is not supported"),
    (dict(hidden_size=None), "no field hidden_size"),
])
def test_what_the_zoo_cannot_honour_is_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.hf.load(hf_fixture(tmp_path, "lfm2", **changes))


@pytest.mark.parametrize("second, message", [
    ({"kind": "attention", "num_heads": 4}, "LFM2's attention has qk_norm"),
    ({"kind": "attention", "num_heads": 4, "qk_norm": True, "norm_eps": 1e-5, "window": 4}, "a window"),
    ({"kind": "gated_conv"}, "at least one attention layer"),
])
def test_save_refuses_what_lfm2_has_no_place_for(tmp_path, second, message):
    cfg = zoo.config.build_model({"d_model": 16, "num_layers": 2, "norm_eps": 1e-5, "ffn": {"kind": "mlp"},
                                  "layer_pattern": [{"kind": "gated_conv"}, second]}, "model")
    with pytest.raises(ValueError, match=message):
        zoo.hf.save(zoo.LanguageModel(cfg, rngs=nnx.Rngs(0)), tmp_path)
