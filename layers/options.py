"""The types of a layer's options, each number with its range, written once in the layer's signature.

A layer's constructor annotates its keyword arguments with these (`num_heads: PosInt = 4`), so the
signature alone says a kind's options, defaults, types, choices and ranges: zoo derives the kind's config from
it and checks every value against the range when a config loads (zoo/schema.py), before any array is
made. A leaf module (it imports nothing of the layers), since layers may not import zoo.
"""

import dataclasses
import math
from typing import Annotated

from kernels import IMPLS, MODES
from kernels.context import SPLITS


@dataclasses.dataclass(frozen=True)
class Range:
    """lo <= x <= hi (a bound None is open-ended; lo_open / hi_open make it strict)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __str__(self):
        lo = "" if self.lo is None else f"{self.lo:g} {'<' if self.lo_open else '<='} "
        hi = "" if self.hi is None else f" {'<' if self.hi_open else '<='} {self.hi:g}"
        return f"{lo}x{hi}"

    def check(self, value, path: str):
        if not math.isfinite(value) or (
                self.lo is not None and (value < self.lo or self.lo_open and value == self.lo)) or (
                self.hi is not None and (value > self.hi or self.hi_open and value == self.hi)):
            raise ValueError(f"{path}: expected {str(self).replace('x', path.rsplit('.', 1)[-1], 1)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OneOf:
    """x is one of `choices`: `Annotated[str, OneOf("window", "full")]` (rather than a Literal, which the
    test suite's run-time type checks would refuse before the layer's own check could name the argument)."""
    choices: tuple

    def __init__(self, *choices):
        object.__setattr__(self, "choices", choices)

    def check(self, value, path: str):
        if value not in self.choices:
            raise ValueError(f"{path}: expected one of {', '.join(map(repr, self.choices))}, got {value!r}")


PosInt = Annotated[int, Range(lo=1)]
NonNegInt = Annotated[int, Range(lo=0)]
PosFloat = Annotated[float, Range(lo=0, lo_open=True)]
NonNegFloat = Annotated[float, Range(lo=0)]
UnitFloat = Annotated[float, Range(0, 1)]  # a fraction or probability in [0, 1]
Impl = Annotated[str, OneOf(*IMPLS)]  # the op's implementation on every path (kernels/)
Mode = Annotated[str, OneOf(*MODES)]  # the training path's exact form, where a family has several
ContextSplit = Annotated[str, OneOf(*SPLITS)]  # which queries a device of the context axis runs (kernels/context.py)
