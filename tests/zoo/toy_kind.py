"""A new mixer kind as a user adds one: a layer class (its signature and docstring are the kind's
options and help) and one registration line, nothing else. Its parameters name no sharding axes, so
they are replicated on a mesh.

    y_t = x_t W_now + x_{t-1} W_prev          (x_{-1} = 0, and 0 at a document start)

Registering changes the registry, so the tests register it only inside `registered()` and remove it
afterwards, leaving the registry as shipped for every other test.
"""

import contextlib

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels.segments import document_starts
from layers.options import Impl, PosFloat
from layers.state import state
from zoo import registry


@state
class ShiftState:
    last: Float[Array, "B D"]  # (B, D) the previous token's input


class ShiftMix(nnx.Module):
    """Token shift mixer (a test's new kind): y_t = x_t W_now + x_{t-1} W_prev; scale: the weights' init scale."""

    def __init__(self, d_model: int, *, scale: PosFloat = 1.0, impl: Impl = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(scale * d_model ** -0.5)
        self.w_now = nnx.Param(init(rngs.params(), (d_model, d_model)))
        self.w_prev = nnx.Param(init(rngs.params(), (d_model, d_model)))
        self.impl, self.dtype = impl, dtype

    def init_state(self, batch_size: int, max_len: int = 0) -> ShiftState:
        return ShiftState(jnp.zeros((batch_size, self.w_now.shape[0]), jnp.float32))

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None):
        return self.decode(x, self.init_state(x.shape[0]), segment_ids=segment_ids)[0]

    def decode(self, x: Float[Array, "B T D"], state: ShiftState, *, segment_ids: Int[Array, "B T"] | None = None):
        x = x.astype(self.dtype)
        prev = jnp.concatenate([state.last[:, None].astype(x.dtype), x[:, :-1]], axis=1)  # (B, T, D)
        if segment_ids is not None:
            prev = jnp.where(document_starts(segment_ids)[..., None], 0, prev)
        y = x @ self.w_now[...].astype(self.dtype) + prev @ self.w_prev[...].astype(self.dtype)
        return y, ShiftState(x[:, -1].astype(jnp.float32))


@contextlib.contextmanager
def registered():
    config_cls = registry.mixer("shift", ShiftMix)
    try:
        yield config_cls
    finally:
        del registry.MIXERS["shift"], registry.LAYER_OF[config_cls]
