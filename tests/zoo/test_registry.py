"""The registry, the configs and the layers agree by construction: a kind's config dataclass is
derived from its layer's signature (keys, defaults, types and ranges) and docstring, and a layer
whose signature cannot say all of that is refused when it registers; every layer inside
LanguageModel is the layer its config and its depth make when built by hand (a key or a model-level
argument that does not reach the layer fails); and a new kind is a layer and one registration line,
nothing else: it configures, trains and decodes (on a mesh: tests/train/test_sharding.py)."""

import dataclasses
import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.options import PosInt
from tests.util import decode_in_pieces, forward
from tests.zoo import toy_kind
from zoo.config import from_dict
from zoo.model import LanguageModel
from zoo.registry import FFNS, LAYER_OF, MIXERS, MODEL_KWARGS, layer_kwargs, mixer

KINDS = [*MIXERS, *FFNS]
NOT_CONFIG = {"self", "d_model", "dtype", "rngs", *MODEL_KWARGS}


def config_cls(kind):
    return MIXERS.get(kind) or FFNS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_config_is_the_layer_signature_with_its_defaults_types_and_help(kind):
    cls = config_cls(kind)
    layer = LAYER_OF[cls]
    hints = typing.get_type_hints(layer.__init__, include_extras=True)
    arguments = {k: (p.default, hints[k]) for k, p in layer_kwargs(layer).items() if k not in NOT_CONFIG}
    fields = typing.get_type_hints(cls, include_extras=True)
    keys = {f.name: (f.default, fields[f.name]) for f in dataclasses.fields(cls)}
    assert list(keys) == list(arguments), f"{kind}: config keys and layer arguments differ"
    assert keys == arguments, f"{kind}: config defaults or types and the layer's differ"
    assert cls.KIND == kind and cls.__doc__ == layer.__doc__ and layer.__doc__.strip()


class _Layer(nnx.Module):
    """A layer whose signature says everything."""

    def __init__(self, d_model: int, *, width: PosInt = 2, dtype=jnp.float32, rngs: nnx.Rngs):
        pass


def _unannotated(self, d_model, *, width=2, rngs):
    pass


def _no_default(self, d_model, *, width: PosInt, rngs):
    pass


def _unranged_int(self, d_model, *, width: int = 2, rngs):
    pass


def _unranged_optional_float(self, d_model, *, rate: float | None = None, rngs):
    pass


def _refused(init, doc="A layer."):
    return type("Bad", (nnx.Module,), {"__init__": init, "__doc__": doc})


@pytest.mark.parametrize("layer,message", [
    (_refused(_unannotated), "Bad.__init__'s width: an option needs a type annotation and a default"),
    (_refused(_no_default), "Bad.__init__'s width: an option needs a type annotation and a default"),
    (_refused(_unranged_int), "Bad.__init__'s width: a number needs its range"),
    (_refused(_unranged_optional_float), "Bad.__init__'s rate: a number needs its range"),
    (_refused(_Layer.__init__, doc=None), "Bad: a kind's layer needs a class docstring"),
])
def test_a_layer_that_does_not_say_its_options_is_refused_at_registration(layer, message):
    with pytest.raises(TypeError, match=message):
        mixer("bad", layer)
    assert "bad" not in MIXERS


def test_a_kind_registers_once():
    cls = mixer("layer", _Layer)
    try:
        assert [(f.name, f.default) for f in dataclasses.fields(cls)] == [("width", 2)]
        with pytest.raises(ValueError, match="kind 'attention' is registered twice"):
            mixer("attention", _Layer)
    finally:
        del MIXERS["layer"], LAYER_OF[cls]
    assert inspect.getdoc(cls) == "A layer whose signature says everything."


def _model_config(kind, num_layers=3):
    mixer = {"kind": kind} if kind in MIXERS else {"kind": "attention"}
    ffn = {"kind": kind} if kind in FFNS else {"kind": "mlp"}
    if kind == "moe":
        ffn.update(num_experts=4, capacity_factor=2.0)
    return from_dict({"model": {"d_model": 64, "num_layers": num_layers, "max_seq_len": 48, "mixer": mixer,
                                "ffn": ffn},
                      "train": {"seq_len": 48}}).model


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_in_the_model_is_the_layer_built_by_hand_from_its_config_and_depth(kind):
    """Static attributes (the graph) equal, and every parameter that does not depend on the seed
    (RWKV's depth-dependent decays and mixes, norms, Mamba's A) equal; the rest equal in shape."""
    cfg = _model_config(kind)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    sub = "mixer" if kind in MIXERS else "ffn"
    layer_cfg = getattr(cfg, sub)
    cls = LAYER_OF[type(layer_cfg)]
    keys = {f.name: getattr(layer_cfg, f.name) for f in dataclasses.fields(layer_cfg)}
    for i, block in enumerate(model.blocks):
        depth = {k: v for k, v in dict(layer_id=i, num_layers=cfg.num_layers, max_seq_len=cfg.max_seq_len).items()
                 if k in layer_kwargs(cls)}
        by_hand = [cls(cfg.d_model, **keys, **depth, rngs=nnx.Rngs(seed)) for seed in (0, 1)]
        inside = getattr(block, sub)
        assert nnx.graphdef(inside) == nnx.graphdef(by_hand[0]), f"block {i}: {kind} built differently"
        a, b = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in by_hand)
        for (path, p0), (_, p1), (_, got) in zip(a, b, nnx.to_flat_state(nnx.state(inside, nnx.Param)), strict=True):
            assert got.shape == p0.shape, (i, path)
            if np.array_equal(p0[...], p1[...]):  # seed-independent: must be the by-hand value
                np.testing.assert_array_equal(got[...], p0[...], err_msg=f"block {i} {kind} {path}")


def test_rwkv_layers_differ_with_depth():
    """The defect this file exists for: blocks 0 and L-1 got identical RWKV initialisations."""
    for kind in ("rwkv6", "rwkv7"):
        model = LanguageModel(_model_config(kind, 4), rngs=nnx.Rngs(0))
        first, last = model.blocks[0].mixer, model.blocks[3].mixer
        assert not np.allclose(first.decay_base[...], last.decay_base[...]), kind
    assert hasattr(model.blocks[1].mixer, "vres_base") and not hasattr(model.blocks[0].mixer, "vres_base")


def test_a_new_kind_is_a_layer_and_a_registration_line(tmp_path):
    from train.loop import run

    with toy_kind.registered() as shift_config:
        data = {"model": {"d_model": 32, "num_layers": 2, "mixer": {"kind": "shift", "scale": 0.5}},
                "train": {"steps": 4, "batch_size": 4, "seq_len": 16, "log_every": 2, "eval_every": 4,
                          "eval_batches": 1, "sample_tokens": 4, "warmup_steps": 1}}
        cfg = from_dict(data)
        assert type(cfg.model.mixer) is shift_config and cfg.model.mixer.scale == 0.5
        with pytest.raises(ValueError, match=r"model\.mixer\.scael: unknown key"):
            from_dict({"model": {"mixer": {"kind": "shift", "scael": 1.0}}})
        last = run(cfg, tmp_path / "run", log=lambda *_: None)
        assert np.isfinite(last["loss"]) and np.isfinite(last["val_loss"]) and "sample" in last
        model = LanguageModel(cfg.model, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
        pieces, _ = decode_in_pieces(model, tokens, cuts=[5, 6, 7, 8])
        np.testing.assert_allclose(pieces, forward(model, tokens), atol=1e-5)
    assert "shift" not in MIXERS
