"""The array face of a weight held in another form around its plain array `base` (an adapted weight,
layers/lora.py; one that records its inputs, layers/gptq.py): shape, ndim and dtype are the base's."""


class HeldWeight:
    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def dtype(self):
        return self.base.dtype
