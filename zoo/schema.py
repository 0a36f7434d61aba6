"""Config dataclasses from plain data and back: the checks every config key goes through.

`build(cls, data, path)` makes a frozen dataclass from a mapping, converting and checking each value
against its field's annotation (int, float, str, bool, Literal or OneOf choices, tuples, unions with
None, nested dataclasses) and naming the dotted `path` of anything wrong. Every number carries its range
(`Annotated[int, Range(lo=1)]`, or an alias of layers/options.py), checked when the config loads, so
a value outside it never reaches an array (tests/zoo/test_config.py checks every numeric key of every
config dataclass has one). An Annotated rule with a `from_data(value, path)` method builds the value itself
(zoo.registry.MixerList: a list of mixer configs, built through the registry). It imports nothing of the
zoo, so the registry of kinds and the run config can both use it.
"""

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

from layers.options import OneOf, Range


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Annotated:
        choices = [c for rule in typing.get_args(tp)[1:] if isinstance(rule, OneOf) for c in rule.choices]
        return " or ".join(map(repr, choices)) if choices else _type_name(typing.get_args(tp)[0])
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _convert(value, tp, path: str):
    """Check `value` against the annotation `tp`, converting int to float and lists to tuples."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        built = [rule for rule in args[1:] if hasattr(rule, "from_data")]
        if built:  # an annotation that builds its own value (zoo.registry.MixerList)
            return built[0].from_data(value, path)
        for rule in args[1:]:
            if isinstance(rule, OneOf):
                rule.check(value, path)
        value = _convert(value, args[0], path)
        for rule in args[1:]:
            if isinstance(rule, Range):
                rule.check(value, path)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ValueError as e:
                errors.append((a, e))
        ranged = [e for _, e in errors if " <" in str(e)]  # the right type, out of range: say so
        if ranged:
            raise ranged[0]
        sections = [e for a, e in errors if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:  # a section's own key was wrong: name that key
            raise sections[0]
        raise ValueError(f"{path}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        if args and args[-1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if args and len(value) != len(args):
            raise ValueError(f"{path}: expected a list of {len(args)}, got {value!r}")
        if not args:
            return tuple(value)
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ValueError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"{path}: unsupported annotation {tp}")


def build(cls, data, path: str):
    """Make dataclass `cls` from a mapping, checking every key and type; `path` names it in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of keys ({', '.join(f.name for f in dataclasses.fields(cls))}), "
                         f"got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)] + (["kind"] if hasattr(cls, "KIND") else [])
    for key in data:
        if key not in names:
            raise ValueError(f"{path}.{key}: unknown key; expected one of {', '.join(names)}")
    kinded = hasattr(cls, "KIND")  # a registry's kind names the class; elsewhere `kind` is a plain field
    kwargs = {k: _convert(v, hints[k], f"{path}.{k}") for k, v in data.items() if k != "kind" or not kinded}
    return cls(**kwargs)


def to_dict(cfg):
    """The resolved config as plain YAML-able data (tuples as lists, mixer kinds included)."""
    if dataclasses.is_dataclass(cfg):
        out = {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        if hasattr(cfg, "KIND"):
            out = {"kind": cfg.KIND, **out}
        return out
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg
