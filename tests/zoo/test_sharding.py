"""Every parameter of every kind and config names its logical axes where it is made (an unnamed one
is replicated); mistakes are errors that name what does not fit. Shapes only (nnx.eval_shape), on
this process's one device; the multi-device runs are in tests/train/test_sharding.py."""

from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from zoo import load_config
from zoo.config import MeshConfig, from_dict
from zoo.model import LanguageModel
from zoo.registry import FFNS, MIXERS
from zoo.sharding import MESH_AXES, logical_axes, make_mesh, partition_spec

CONFIGS = sorted(Path(__file__).parents[2].glob("configs/*.yaml"))
# Options that add parameters beyond a kind's defaults.
EXTRA = {"linear_attention": [{"feature_map": "hedgehog"}, {"feature_map": "performer"}],
         "gla": [{"conv_size": 4, "use_output_gate": False}],
         "deltanet": [{"use_output_gate": True, "use_beta": False}],
         "mamba": [{"conv_size": 0}], "mamba2": [{"conv_size": 0}], "attention": [{"num_kv_heads": 1}],
         "mla": [{"q_lora_rank": 32}]}


def abstract_model(mixer: dict, ffn: dict, **model) -> nnx.Module:
    cfg = from_dict({"model": {"d_model": 128, "num_layers": 2, "mixer": mixer, "ffn": ffn, **model}})
    return nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)))


def mesh(**sizes) -> AbstractMesh:
    return AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES)


def check_covered(model: nnx.Module):
    """Every matrix (rank >= 2) of a shipped layer says how it shards, replicated included: only
    vectors may go unnamed. The names have the parameter's rank and fit a mesh."""
    axes = logical_axes(model)
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(axes) == len(params)
    for path, param in params:
        assert len(param.shape) < 2 or "axes" in param.get_metadata(), f"{path}: no axes named"
        partition_spec("/".join(map(str, path)), param.shape, axes[path], mesh(fsdp=2))


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_every_mixer_kind_names_the_axes_of_its_parameters(kind):
    for options in [{}, *EXTRA.get(kind, [])]:
        check_covered(abstract_model({"kind": kind, **options}, {"kind": "mlp"}))


@pytest.mark.parametrize("kind", sorted(FFNS))
def test_every_ffn_kind_names_the_axes_of_its_parameters(kind):
    options = [{}, {"num_shared_experts": 1}] if kind == "moe" else [{}]
    for o in options:
        check_covered(abstract_model({"kind": "rwkv7"}, {"kind": kind, **o}, tie_embeddings=False,
                                     exits={"layers": [1], "weights": [0.5], "own_head": True}))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_shards_on_a_mesh_of_every_axis(path):
    cfg = load_config(path)
    model = nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)))
    axes = logical_axes(model)
    for p, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        partition_spec("/".join(map(str, p)), param.shape, axes[p], mesh(fsdp=2, tensor=2, expert=2))


def test_rules_split_heads_and_width_as_documented():
    model = abstract_model({"kind": "attention", "num_heads": 4}, {"kind": "moe"})
    axes = {"/".join(map(str, p)): a for p, a in logical_axes(model).items()}
    m = mesh(data=2, fsdp=2, tensor=2, expert=2)
    spec = {k: partition_spec(k, (8,) * len(a), a, m) for k, a in axes.items()}
    assert spec["blocks/0/mixer/wq"] == PartitionSpec("fsdp", "tensor", None)
    assert spec["blocks/0/mixer/wo"] == PartitionSpec("tensor", None, "fsdp")
    assert spec["blocks/0/ffn/w_up"] == PartitionSpec("expert", "fsdp", "tensor")
    assert spec["embed/embedding"] == PartitionSpec("tensor", "fsdp")
    assert spec["norm/weight"] == PartitionSpec(None)
    # Mamba-2 keeps its fused convolution whole, Mamba splits its channels.
    path = ("blocks", 0, "mixer", "conv", "weight")
    conv = {kind: logical_axes(abstract_model({"kind": kind}, {"kind": "mlp"}))[path] for kind in ("mamba", "mamba2")}
    assert conv == {"mamba2": (None, None), "mamba": (None, "heads")}


def test_an_unnamed_parameter_is_replicated_and_a_wrong_name_is_an_error_naming_it():
    model = abstract_model({"kind": "gla"}, {"kind": "mlp"})
    model.blocks[1].mixer.extra = nnx.Param(jnp.zeros((3, 4)))
    assert logical_axes(model)[("blocks", 1, "mixer", "extra")] == (None, None)
    model.blocks[1].mixer.extra = nnx.Param(jnp.zeros((3, 4)), axes=("embed",))
    with pytest.raises(ValueError, match=r"blocks/1/mixer/extra: its axes \('embed',\) name 1 dimensions"):
        logical_axes(model)
    model.blocks[1].mixer.extra = nnx.Param(jnp.zeros((3, 4)), axes=("embed", "hedas"))
    with pytest.raises(ValueError, match=r"blocks/1/mixer/extra: unknown logical axes \['hedas'\]"):
        logical_axes(model)


def test_fewer_kv_heads_than_tensor_ranks_are_copied_not_an_error():
    m = mesh(tensor=4)
    assert partition_spec("wk", (128, 1, 32), ("embed", "kv_heads", None), m) == PartitionSpec(None, None, None)
    assert partition_spec("wk", (128, 8, 32), ("embed", "kv_heads", None), m) == PartitionSpec(None, "tensor", None)


def test_an_axis_that_does_not_divide_names_the_parameter_and_the_axis():
    with pytest.raises(ValueError, match=r"train.mesh.tensor=8 does not divide dimension 1 \(heads, size 4\) of "
                                         r"parameter blocks/0/mixer/wq \(shape \(128, 4, 32\)\)"):
        partition_spec("parameter blocks/0/mixer/wq", (128, 4, 32), ("embed", "heads", None), mesh(tensor=8))


def test_a_mesh_that_is_not_the_device_count_is_an_error_naming_both():
    assert make_mesh(MeshConfig()).shape["data"] == 1  # the default: every device on data
    with pytest.raises(ValueError, match=r"data=2 x fsdp=1 x tensor=1 x expert=1 x context=1 is 2 devices, but there "
                                         r"are 1"):
        make_mesh(MeshConfig(data=2))
    with pytest.raises(ValueError, match=r"fsdp=2 x tensor=1 x expert=1 x context=1 cannot fill 1 devices"):
        make_mesh(MeshConfig(data=-1, fsdp=2))


@pytest.mark.parametrize("mesh_cfg, message", [
    ({"data": 0}, r"train.mesh.data: expected a positive number of devices or -1"),
    ({"data": -1, "tensor": -1}, r"train.mesh: at most one axis may be -1"),
    ({"model": 2}, r"train.mesh.model: unknown key; expected one of data, fsdp, tensor, expert"),
    ({"fsdp": 1.5}, r"train.mesh.fsdp: expected int")])
def test_mesh_config_errors_name_the_key(mesh_cfg, message):
    with pytest.raises(ValueError, match=message):
        from_dict({"train": {"mesh": mesh_cfg}})
