"""The token shift of RWKV's time and channel mixing (RWKV-6, RWKV-7): every token reads the one
before it, zero at a document start, and the last token of a call carries over to the next call in
the layers' states (defined here, one for each kind of mixing)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import document_starts
from layers.state import state


@state
class RWKVTimeMixState:
    shift: Float[Array, "B D"]  # (B, D) float32: the previous token's input, for the token shift
    wkv: Float[Array, "B H K V"]  # (B, H, K, V) float32: the WKV recurrent state


@state
class RWKVChannelMixState:
    shift: Float[Array, "B D"]  # (B, D) float32: the previous token's input, for the token shift


def token_shift(x: Float[Array, "B T D"], last: Float[Array, "B D"], segment_ids: Int[Array, "B T"] | None,
                steps: bool = False):
    """(x_{t-1} for every t, the new last token). x_{-1} is `last`; at a document start it is zero.
    With `steps`, the last token after every token: (T, B, D) (layers/state.py)."""
    prev = jnp.concatenate([last[:, None].astype(x.dtype), x[:, :-1]], axis=1)  # (B, T, D)
    if segment_ids is not None:
        prev = jnp.where(document_starts(segment_ids)[..., None], 0, prev)
    return prev, (jnp.swapaxes(x, 0, 1) if steps else x[:, -1]).astype(jnp.float32)
