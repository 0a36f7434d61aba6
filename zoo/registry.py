"""The registry of kinds: `kind` in a config -> (config dataclass, layer class).

A kind is written once, in its layer: the constructor's keyword arguments, annotated with their
types and ranges (layers/options.py), are its options with their defaults, the class docstring is
its help, and the constructor's checks are its checks. Registering it is one line (zoo/kinds.py):

    mixer("gla", layers.GatedLinearAttention)

which derives the kind's frozen config dataclass from the signature (every keyword argument besides
d_model, dtype, rngs and the model-level MODEL_KWARGS), so adding an architecture is one layer file,
one registration line and one YAML file: nothing here, in the model, the training loop or the decoder
changes. `Kind.check` validates a config against the model width before any array exists: it builds
the layer abstractly (nnx.eval_shape) and re-raises the layer's own ValueError under the config's
dotted path.
"""

import dataclasses
import functools
import inspect
import re
import typing
from typing import Annotated, Any, ClassVar

import jax.numpy as jnp
from flax import nnx

from layers.options import Range
from zoo.schema import build

MIXERS: dict[str, type] = {}  # kind -> config dataclass
FFNS: dict[str, type] = {}
LAYER_OF: dict[type, type] = {}  # config dataclass -> layer class
# Keyword arguments the model gives a layer that takes them, which are not keys of its config:
# its depth (RWKV's depth-dependent initialisation) and the trained context (attention past it).
MODEL_KWARGS = ("layer_id", "num_layers", "max_seq_len")
NOT_OPTIONS = ("self", "d_model", "dtype", "rngs", *MODEL_KWARGS)


class Kind:
    """Base of the config dataclasses of mixers and FFNs."""
    KIND: ClassVar[str]

    def check(self, d_model: int, path: str):
        try:
            _build_abstract(self, d_model)
        except ValueError as e:
            raise ValueError(_under(path, str(e), {f.name for f in dataclasses.fields(self)})) from None


def _under(path: str, message: str, keys: set[str]) -> str:
    """A layer's error under the config's dotted path: one that starts with one of its keys
    (`num_heads=3 ...`, `MoE: top_k=5 ...`, `head_masks[1]: ...`) names that key's path."""
    m = re.match(r"(?:\w+: |\w+\.)?(\w+)(=|: |\[)", message)
    if m is None or m[1] not in keys:
        return f"{path}: {message}"
    return f"{path}.{m[1]}{'[' if m[2] == '[' else ': '}{message[m.end():]}"


def unranged(tp, where: str) -> list[str]:
    """The places inside annotation `tp` where an int or float has no Range."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return [] if any(isinstance(a, Range) for a in args[1:]) else unranged(args[0], where)
    if tp in (int, float):
        return [where]
    if dataclasses.is_dataclass(tp):
        return [p for f, t in typing.get_type_hints(tp, include_extras=True).items() if f != "KIND"
                for p in unranged(t, f"{where}.{f}")]
    return [p for a in args if a is not Ellipsis for p in unranged(a, where)]


def layer_kwargs(cls) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a layer class's constructor (its own __init__: the signature of an
    nnx.Module class itself is its metaclass's (*args, **kwargs))."""
    return dict(inspect.signature(cls.__init__).parameters)


def options(layer_cls: type) -> list[tuple[str, Any, dataclasses.Field]]:
    """A layer's options as dataclass fields: (name, annotation, field with the default), in its
    signature's order. Each needs a default and an annotation, and each number a Range."""
    hints = typing.get_type_hints(layer_cls.__init__, include_extras=True)
    fields = []
    for name, p in layer_kwargs(layer_cls).items():
        if name in NOT_OPTIONS:
            continue
        where = f"{layer_cls.__name__}.__init__'s {name}"
        if name not in hints or p.default is inspect.Parameter.empty:
            raise TypeError(f"{where}: an option needs a type annotation and a default")
        if unranged(hints[name], name):
            raise TypeError(f"{where}: a number needs its range, e.g. PosInt or Annotated[float, Range(0, 1)] "
                            f"(layers/options.py); got {hints[name]}")
        fields.append((name, hints[name], dataclasses.field(default=p.default)))
    return fields


def _register(table: dict, kind: str, layer_cls: type) -> type:
    if kind in MIXERS or kind in FFNS:
        raise ValueError(f"kind {kind!r} is registered twice")
    if not layer_cls.__dict__.get("__doc__"):
        raise TypeError(f"{layer_cls.__name__}: a kind's layer needs a class docstring (the kind's help)")
    config_cls = dataclasses.make_dataclass(
        f"{layer_cls.__name__}Config", options(layer_cls), bases=(Kind,), frozen=True,
        namespace={"KIND": kind, "__doc__": layer_cls.__doc__, "__module__": __name__})
    table[kind] = config_cls
    LAYER_OF[config_cls] = layer_cls
    return config_cls


def mixer(kind: str, layer_cls: type) -> type:
    """Register `layer_cls` as the sequence-mixer kind `kind`; returns its derived config dataclass."""
    return _register(MIXERS, kind, layer_cls)


def ffn(kind: str, layer_cls: type) -> type:
    """Register `layer_cls` as the FFN kind `kind`; returns its derived config dataclass."""
    return _register(FFNS, kind, layer_cls)


def build_kind(table: dict, data, path: str):
    if not isinstance(data, dict):  # a list or a scalar where a kind's keys belong
        raise ValueError(f"{path}: expected a mapping with a kind key (one of {', '.join(table)}), got "
                         f"{type(data).__name__} {data!r}")
    if "kind" not in data:
        raise ValueError(f"{path}.kind: missing; expected one of {', '.join(table)}")
    if not isinstance(data["kind"], str) or data["kind"] not in table:
        raise ValueError(f"{path}.kind: unknown kind {data['kind']!r}; expected one of {', '.join(table)}")
    return build(table[data["kind"]], data, path)


class MixerConfigs:
    """How the schema builds an option annotated `MixerList`: a non-empty list of mappings, each with its kind as an
    entry of model.layer_pattern, built through the registry into a tuple of frozen configs; configs already built
    pass as they are."""

    @staticmethod
    def from_data(value, path: str) -> tuple:
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{path}: expected a non-empty list of mixer configs (mappings with a kind key), got "
                             f"{value!r}")
        return tuple(v if isinstance(v, Kind) else build_kind(MIXERS, v, f"{path}[{i}]") for i, v in enumerate(value))


MixerList = Annotated[tuple, MixerConfigs]  # an option holding mixer configs (zoo/parallel.py's `mixers`)


def make_layer(cfg, d_model: int, *, dtype=jnp.float32, rngs: nnx.Rngs, **model_kwargs):
    """The layer of a config. `model_kwargs` (MODEL_KWARGS: layer_id, num_layers, max_seq_len) reach
    the layers whose constructor takes them."""
    cls = LAYER_OF[type(cfg)]
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    takes = layer_kwargs(cls)
    kwargs.update({k: v for k, v in model_kwargs.items() if k in takes})
    return cls(d_model, **kwargs, dtype=dtype, rngs=rngs)


@functools.lru_cache(maxsize=1024)  # a sweep checks each (kind config, width) once, not once per cell
def _build_abstract(cfg: Kind, d_model: int):
    """Build the layer abstractly (no weights made): its constructor's checks raise here."""
    nnx.eval_shape(lambda: make_layer(cfg, d_model, rngs=nnx.Rngs(0)))
