from pathlib import Path

import pytest

from zoo import load_config
from zoo.config import Config, from_dict
from zoo.schema import to_dict

CONFIGS = sorted(Path(__file__).parents[2].glob("configs/*.yaml"))
DEFAULT = Path(__file__).parents[2] / "configs" / "transformer.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_loads_and_starts_with_its_command(path):
    load_config(path)
    head = path.read_text().splitlines()[:3]
    assert head[0].startswith(f"# python -m train configs/{path.name}")
    assert any("2 CPU cores" in line for line in head) and any("validation loss" in line.lower() for line in head)


def test_overrides_reach_nested_keys():
    cfg = load_config(DEFAULT, ["model.num_layers=2", "model.mixer.num_kv_heads=1", "train.lr=1e-3",
                                   "model.mixer.window=null", "data.val_docs=[hamlet]"])
    assert (cfg.model.num_layers, cfg.model.mixer.num_kv_heads, cfg.train.lr) == (2, 1, 1e-3)
    assert cfg.data.val_docs == ("hamlet",) and cfg.model.mixer.window is None


def test_an_ffn_pattern_repeats_over_the_layers_and_round_trips():
    cfg = from_dict({"model": {"num_layers": 5, "ffn_pattern": [{"kind": "mlp", "hidden_dim": 64}, {"kind": "none"}]}})
    assert [f.KIND for f in cfg.model.ffns()] == ["mlp", "none", "mlp", "none", "mlp"] and cfg.model.ffn is None
    assert from_dict(to_dict(cfg)) == cfg


def test_a_parallel_mixers_parts_are_built_configs_and_round_trip():
    cfg = from_dict({"model": {"mixer": {"kind": "parallel", "mixers": [{"kind": "mamba2", "d_inner": 96,
                                                                          "head_dim": 16}, {"kind": "attention"}]}}})
    mamba2, attention = cfg.model.mixer.mixers
    assert (mamba2.KIND, mamba2.d_inner, attention.KIND) == ("mamba2", 96, "attention")
    assert hash(cfg.model.mixer) and from_dict(to_dict(cfg)) == cfg  # frozen: the registry caches its checks


@pytest.mark.parametrize("data,field", [
    ({"model": {"d_modle": 64}}, "model.d_modle: unknown key"),
    ({"model": {"mixer": {"kind": "attention", "heads": 4}}}, "model.mixer.heads: unknown key"),
    ({"trainer": {}}, "trainer: unknown section"),
    ({"model": {"d_model": "wide"}}, "model.d_model: expected int"),
    ({"train": {"lr": "fast"}}, "train.lr: expected float"),
    ({"train": {"schedule": "exp"}}, "train.schedule: expected one of"),
    ({"model": {"mixer": {"kind": "attention", "num_heads": 3}}}, "model.mixer.num_heads: 3 does not divide"),
    ({"model": {"mixer": {"kind": "attention", "num_kv_heads": 3}}}, "model.mixer.num_kv_heads: 3 does not divide"),
    ({"model": {"layer_pattern": [{"kind": "attention"}, {"kind": "attention", "num_kv_heads": 3}]}},
     "model.layer_pattern[1].num_kv_heads"),
    ({"model": {"mixer": {"kind": "transformer"}}}, "model.mixer.kind: unknown kind 'transformer'"),
    # a parallel mixer's parts: built through the registry, each named by its index
    ({"model": {"mixer": {"kind": "parallel", "mixers": []}}}, "model.mixer.mixers: expected a non-empty list"),
    ({"model": {"mixer": {"kind": "parallel", "mixers": [{"kind": "mamba2"}, {"kind": "attention", "heads": 2}]}}},
     "model.mixer.mixers[1].heads: unknown key"),
    ({"model": {"mixer": {"kind": "parallel", "mixers": [{"kind": "attention", "num_heads": 3}]}}},
     "model.mixer.mixers[0]: num_heads=3 does not divide d_model=128"),
    ({"model": {"mixer": {"kind": "parallel", "mixers": [{"kind": "rwkv7"}]}}},
     "model.mixer.mixers[0]: kind 'rwkv7' cannot be a part of parallel (its value residual crosses layers)"),
    ({"model": {"mixer": {"num_heads": 4}}}, "model.mixer.kind: missing"),
    ({"model": {"d_model": -8}}, "model.d_model: expected 1 <= d_model, got -8"),
    ({"model": {"max_seq_len": 64}, "train": {"seq_len": 128}}, "train.seq_len: 128 is longer than the model allows"),
    ({"train": {"batch_size": 6, "grad_accum": 4}}, "train.grad_accum"),
    ({"model": {"ffn": {"kind": "moe", "num_experts": 4, "top_k": 5}}}, "model.ffn.top_k: 5 must be between 1 and"),
    ({"model": {"ffn": {"kind": "moe", "capacity_factor": 0}}}, "model.ffn.capacity_factor: expected 0 <"),
    ({"model": {"ffn": {"kind": "moe", "num_experts": 0, "top_k": 0, "num_shared_experts": 1}}},
     "model.ffn.num_experts: expected 1 <= num_experts, got 0"),
    ({"model": {"ffn": {"kind": "moe", "router": "hash"}}}, "model.ffn.router: expected one of"),
    ({"model": {"d_model": 32, "layer_pattern": [{"kind": "attention"}, {"kind": "rwkv7", "head_dim": 16}]}},
     "model.layer_pattern[0]: RWKV-7's value residual"),
])
def test_errors_name_the_field(data, field):
    with pytest.raises(ValueError) as e:
        from_dict(data)
    assert field in str(e.value)


def test_missing_file_bad_yaml_and_bad_override(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ValueError, match="dotted.path=value"):
        load_config(DEFAULT, ["model.d_model"])


def test_every_number_of_every_config_has_a_range():
    """A number without a range would accept nonsense silently (a negative learning rate, 0 heads):
    every numeric key of the run config, of every kind and of every task declares one (zoo/schema.py)."""
    from zoo.registry import FFNS, MIXERS, unranged
    from zoo.tasks import TASKS

    found = unranged(Config, "config")
    for table in (MIXERS, FFNS, TASKS):
        for kind, cls in table.items():
            found += unranged(cls, kind)
    assert not found, f"numeric keys without a Range: {found}"


@pytest.mark.parametrize("data,field", [
    ({"train": {"grad_clip": -1}}, "train.grad_clip: expected 0 <= grad_clip, got -1"),
    ({"train": {"weight_decay": -0.5}}, "train.weight_decay: expected 0 <= weight_decay"),
    ({"train": {"b1": 1.5}}, "train.b1: expected 0 <= b1 < 1, got 1.5"),
    ({"train": {"sample_tokens": -5}}, "train.sample_tokens: expected 0 <= sample_tokens"),
    ({"train": {"lr": 0}}, "train.lr: expected 0 < lr"),
    ({"model": {"norm_eps": -1}}, "model.norm_eps: expected 0 < norm_eps"),
    ({"model": {"vocab_size": 64}}, "model.vocab_size: 64 is smaller than the tokenizer's 256 ids"),
    ({"model": {"mixer": {"kind": "attention", "num_heads": 0}}}, "model.mixer.num_heads: expected 1 <= num_heads"),
    ({"model": {"mixer": {"kind": "gla", "num_heads": -2}}}, "model.mixer.num_heads: expected 1 <= num_heads, got -2"),
    ({"model": {"mixer": {"kind": "mamba2", "A_init_range": [0, 1]}}}, "model.mixer.A_init_range[0]: expected 0 <"),
    ({"model": {"mixer": {"kind": "mamba2", "A_init_range": [1]}}}, "model.mixer.A_init_range: expected a list of 2"),
    ({"model": 5}, "model: expected a mapping of model keys, got 5"),
    ({"train": [1, 2]}, "train: expected a mapping of train keys"),
])
def test_out_of_range_values_are_refused_by_name(data, field):
    with pytest.raises(ValueError) as e:
        from_dict(data)
    assert field in str(e.value)


@pytest.mark.parametrize("text", ["- model\n- train\n", "5\n", "just words\n"])
def test_a_config_that_is_not_a_mapping_is_refused_by_file(tmp_path, text):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.yaml'?: expected a mapping of sections \(model, data, train\)"):
        load_config(bad)
    with pytest.raises(ValueError, match="expected a mapping of sections"):
        load_config(bad, ["model.d_model=64"])


@pytest.mark.parametrize("data,field", [
    ({"model": {"mixer": ["attention"]}}, "model.mixer: expected a mapping with a kind key (one of attention"),
    ({"model": {"mixer": "attention"}}, "model.mixer: expected a mapping with a kind key"),
    ({"model": {"ffn": [1]}}, "model.ffn: expected a mapping with a kind key (one of none, mlp"),
    ({"model": {"mixer": {"kind": ["attention"]}}}, "model.mixer.kind: unknown kind ['attention']"),
    ({"model": {"layer_pattern": [{"kind": "attention"}, "gla"]}}, "model.layer_pattern[1]: expected a mapping with"),
    ({"model": {"layer_pattern": "attention"}}, "model.layer_pattern: expected a non-empty list of mixer configs"),
    ({"model": {"ffn_pattern": "mlp"}}, "model.ffn_pattern: expected a non-empty list of FFN configs"),
    ({"model": {"ffn_pattern": [{"kind": "mlp"}, "moe"]}}, "model.ffn_pattern[1]: expected a mapping with"),
    ({"model": {"ffn": {"kind": "mlp"}, "ffn_pattern": [{"kind": "mlp"}]}},
     "model.ffn_pattern: give either model.ffn or model.ffn_pattern, not both"),
    ({"model": {"exits": [1, 2]}}, "model.exits: expected a mapping of keys (layers, weights"),
    ({"data": {"task": ["mqar"]}}, "data.task: expected a mapping with a kind key (one of mqar"),
    ({"data": {"tokenizer": "bpe"}}, "data.tokenizer: expected a mapping of keys (kind, vocab_size"),
    ({"train": {"mesh": [2]}}, "train.mesh: expected a mapping of keys (data, fsdp"),
])
def test_a_section_that_is_not_a_mapping_is_refused_by_path(data, field):
    with pytest.raises(ValueError) as e:
        from_dict(data)
    assert field in str(e.value)


def test_train_command_prints_an_error_for_a_list_config(tmp_path, capsys):
    from train.__main__ import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("- model\n- train\n")
    with pytest.raises(SystemExit) as e:
        main([str(bad)])
    message = str(e.value.code)
    assert message.startswith("error: config ") and "expected a mapping of sections" in message
    assert "Traceback" not in message + capsys.readouterr().err


# Every shipped config of a text corpus and a new model (a task has its own ids; init_from, its model's).
TEXT_CONFIGS = [p for p in CONFIGS if "task:" not in p.read_text() and "init_from:" not in p.read_text()]


@pytest.mark.parametrize("path", TEXT_CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_follow_a_bpe_tokenizer(path):
    """Switching a shipped config to BPE needs no model.vocab_size=null: none pins the byte vocabulary."""
    cfg = load_config(path, ["data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=300"])
    assert cfg.model.vocab_size == 300


def test_a_pinned_vocabulary_too_small_for_the_tokenizer_says_what_to_pass():
    with pytest.raises(ValueError, match=r"model.vocab_size: 256 is smaller than the tokenizer's 300 ids .*pass "
                                         r"model.vocab_size=null to follow the tokenizer, or at least 300"):
        load_config(DEFAULT, ["data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=300", "model.vocab_size=256"])
