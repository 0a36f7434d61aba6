from pathlib import Path

import pytest

from zoo import load_config
from zoo.config import Config, from_dict

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
