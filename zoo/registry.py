"""The registry of kinds: `kind` in a config -> (config dataclass, layer class).

A kind registers itself where its config dataclass is defined (zoo/kinds.py):

    @mixer(layers.GatedLinearAttention)
    @dataclass(frozen=True)
    class GLAConfig(Chunked):
        KIND: ClassVar[str] = "gla"
        num_heads: int = 4
        ...

The dataclass's fields are exactly its layer's keyword arguments (besides d_model, dtype, rngs and
the model-level MODEL_KWARGS), with the layer's defaults (tests/zoo/test_registry.py checks both),
so adding an architecture is one layer file, one dataclass with its decorator, and one YAML file:
nothing here, in the model, the training loop or the decoder changes. `check` validates a config
against the model width before any array exists: it builds the layer abstractly (nnx.eval_shape)
and re-raises the layer's own ValueError under the config's dotted path.
"""

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import ClassVar, Literal

import jax.numpy as jnp
from flax import nnx

from kernels import IMPLS, MODES
from zoo.schema import PosInt, build

MIXERS: dict[str, type] = {}  # kind -> config dataclass
FFNS: dict[str, type] = {}
LAYER_OF: dict[type, type] = {}  # config dataclass -> layer class
# Keyword arguments the model gives a layer that takes them, which are not keys of its config:
# its depth (RWKV's depth-dependent initialisation) and the trained context (attention past it).
MODEL_KWARGS = ("layer_id", "num_layers", "max_seq_len")


def _register(table: dict, layer_cls: type):
    def add(config_cls: type) -> type:
        if config_cls.KIND in MIXERS or config_cls.KIND in FFNS:
            raise ValueError(f"kind {config_cls.KIND!r} is registered twice")
        table[config_cls.KIND] = config_cls
        LAYER_OF[config_cls] = layer_cls
        return config_cls
    return add


def mixer(layer_cls: type):
    """Class decorator: register a config dataclass as the sequence-mixer kind of `layer_cls`."""
    return _register(MIXERS, layer_cls)


def ffn(layer_cls: type):
    """Class decorator: register a config dataclass as the FFN kind of `layer_cls`."""
    return _register(FFNS, layer_cls)


def build_kind(table: dict, data, path: str):
    if not isinstance(data, dict) or "kind" not in data:
        raise ValueError(f"{path}.kind: missing; expected one of {', '.join(table)}")
    if data["kind"] not in table:
        raise ValueError(f"{path}.kind: unknown kind {data['kind']!r}; expected one of {', '.join(table)}")
    return build(table[data["kind"]], data, path)


def layer_kwargs(cls) -> dict[str, inspect.Parameter]:
    """The keyword parameters of a layer class's constructor (its own __init__: the signature of an
    nnx.Module class itself is its metaclass's (*args, **kwargs))."""
    return dict(inspect.signature(cls.__init__).parameters)


def make_layer(cfg, d_model: int, *, dtype=jnp.float32, rngs: nnx.Rngs, **model_kwargs):
    """The layer of a config. `model_kwargs` (MODEL_KWARGS: layer_id, num_layers, max_seq_len) reach
    the layers whose constructor takes them."""
    cls = LAYER_OF[type(cfg)]
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    takes = layer_kwargs(cls)
    kwargs.update({k: v for k, v in model_kwargs.items() if k in takes})
    return cls(d_model, **kwargs, dtype=dtype, rngs=rngs)


class Kind:
    """Base of the config dataclasses of mixers and FFNs."""
    KIND: ClassVar[str]

    def check(self, d_model: int, path: str):
        try:
            _build_abstract(self, d_model)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


@functools.lru_cache(maxsize=1024)  # a sweep checks each (kind config, width) once, not once per cell
def _build_abstract(cfg: Kind, d_model: int):
    """Build the layer abstractly (no weights made): its constructor's checks raise here."""
    nnx.eval_shape(lambda: make_layer(cfg, d_model, rngs=nnx.Rngs(0)))


@dataclass(frozen=True)
class Mixer(Kind):
    """Base of the mixer configs: impl picks the op's implementation on every path (kernels/)."""
    impl: Literal[IMPLS] = "auto"


@dataclass(frozen=True)
class Chunked(Mixer):
    """Base of the mixers with several exact forms: mode picks the training path's, chunk_size the
    chunk of the chunk form; every mode computes the same function."""
    mode: Literal[MODES] = "chunk"
    chunk_size: PosInt = 64
