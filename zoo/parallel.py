"""Parallel mixers: several sequence mixers of any registered kinds reading the same normed input, their
outputs summed, as one block's mixer,

    y = mixer_1(x) + ... + mixer_n(x)

Falcon-H1's hybrid layer (Zuo et al., 2025, arXiv 2507.22448: Mamba-2 and attention side by side in every
layer) and Hymba's hybrid heads (Dong et al., 2024, arXiv 2411.13676, there with a mean of normed outputs:
a norm per part and learnt scales, which the parts' own options and weights hold) are this kind. Each part
is configured as an entry of model.layer_pattern is ({kind: ..., ...}) and built as that layer would be,
with the model's arguments (layer_id, num_layers, max_seq_len). Its decode state is the tuple of the parts'
states; decode (steps=True included) and rollback go to each part; `impl` set on the layer reaches every
part that has one (the parts' modes stay their own configs'). A scale on a part's input or output (Falcon-H1's
multipliers) is a scale of its weights: zoo.hf.falcon_h1 folds them in.

It builds its parts through the registry, so it lives in zoo/ rather than layers/ (which never imports zoo).
"""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from layers.mixer import SequenceMixer
from zoo.registry import LAYER_OF, MIXERS, MixerConfigs, MixerList, build_kind, make_layer

PAIR = tuple(build_kind(MIXERS, {"kind": k}, "Parallel") for k in ("mamba2", "attention"))  # the default parts


class Parallel(SequenceMixer):
    """Parallel mixers (Falcon-H1, Hymba): the sum of the outputs of several mixers reading the same input; mixers: a
    list of mixer configs, each with its kind as an entry of model.layer_pattern (default: a mamba2 and an attention
    at their defaults), every kind but rwkv7 (whose value residual crosses layers) and parallel itself; dtype: the
    compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, mixers: MixerList = PAIR, layer_id: int = 0, num_layers: int = 1,
                 max_seq_len: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        configs = MixerConfigs.from_data(mixers, "Parallel: mixers")
        parts = []
        for i, cfg in enumerate(configs):
            layer_cls = LAYER_OF[type(cfg)]
            if layer_cls is Parallel or getattr(layer_cls, "carries_v_first", False):
                why = "a parallel inside another" if layer_cls is Parallel else "its value residual crosses layers"
                raise ValueError(f"mixers[{i}]: kind {cfg.KIND!r} cannot be a part of parallel ({why})")
            try:
                parts.append(make_layer(cfg, d_model, dtype=dtype, rngs=rngs, layer_id=layer_id,
                                        num_layers=num_layers, max_seq_len=max_seq_len))
            except ValueError as e:
                raise ValueError(f"mixers[{i}]: {e}") from None
        self.d_model, self.mixers = d_model, nnx.List(parts)
        self.grows_with_context = any(m.grows_with_context for m in parts)  # a KV cache among the parts

    @property
    def impl(self) -> tuple:
        """The parts' implementations; setting it sets every part's that has one."""
        return tuple(getattr(m, "impl", None) for m in self.mixers)

    @impl.setter
    def impl(self, value: str):
        for m in self.mixers:
            if hasattr(m, "impl"):
                m.impl = value

    def init_state(self, batch_size: int, max_len: int) -> tuple:
        """The parts' states, in order."""
        return tuple(m.init_state(batch_size, max_len) for m in self.mixers)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        self._check(x, segment_ids)
        ys = [m(x, segment_ids=segment_ids) for m in self.mixers]
        return sum(ys[1:], ys[0])

    def decode(self, x: Float[Array, "B T D"], state: tuple, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T D"], tuple]:
        self._check(x, segment_ids, steps)
        steps = {"steps": True} if steps else {}  # asked for only when used, as the model's blocks do
        out = [m.decode(x, s, segment_ids=segment_ids, **steps) for m, s in zip(self.mixers, state, strict=True)]
        return sum((y for y, _ in out[1:]), out[0][0]), tuple(s for _, s in out)

    def rollback(self, stepped: tuple, drop: Int[Array, " B"]) -> tuple:
        return tuple(m.rollback(s, drop) for m, s in zip(self.mixers, stepped, strict=True))
