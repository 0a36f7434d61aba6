"""The array face of a weight held in another form: `HeldWeight` around its plain array `base` (an
adapted weight, layers/lora.py; one that records its inputs, layers/gptq.py), whose shape, ndim and dtype
are the base's; `HeldMatrix`, a weight of logical `shape` held as some form of its (In, Out) matrix
(factors, layers/factor.py; scaled input channels, layers/smooth.py)."""

import dataclasses
import math


class HeldWeight:
    """For a dataclass with fields `base` and `in_ndim` (its contraction axes): `w[...]` is itself, the
    (In, Out) view `project` asks for is itself around the base as a matrix, and any other read gets
    the plain base."""

    def __getitem__(self, key):
        return self if key is Ellipsis else self.base[key]

    def astype(self, dtype):
        return dataclasses.replace(self, base=self.base.astype(dtype))

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        In = math.prod(self.base.shape[:self.in_ndim])
        if tuple(shape) in ((In, self.base.size // In), (In, -1)):
            return dataclasses.replace(self, base=self.base.reshape(In, -1), in_ndim=1)
        return self.base.reshape(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def dtype(self):
        return self.base.dtype


class HeldMatrix:
    """For a dataclass with fields `shape` (the logical shape: `in_ndim` contraction axes, then output
    axes) and `in_ndim`, and a method `matrix()` giving the (In, Out) weight: `w[...]` is itself, the
    (In, Out) view `project` asks for is itself as a matrix, and any other read gets the weight."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __jax_array__(self):
        return self.matrix().reshape(self.shape)

    def __getitem__(self, key):
        return self if key is Ellipsis else self.__jax_array__()[key]

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        In, Out = math.prod(self.shape[:self.in_ndim]), math.prod(self.shape[self.in_ndim:])
        if tuple(shape) in ((In, Out), (In, -1)):
            return dataclasses.replace(self, shape=(In, Out), in_ndim=1)
        return self.__jax_array__().reshape(shape)
