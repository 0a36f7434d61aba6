"""The official RWKV initialisation helpers (BlinkDL/RWKV-LM), shared by RWKV-6 and RWKV-7: the depth
ratios that scale every per-channel init, orthogonal matrices, and float32 parameters with their
logical axes."""

import jax
import jax.numpy as jnp
from flax import nnx

from layers.sharding import axes


def depth_ratios(layer_id: int, num_layers: int) -> tuple[float, float]:
    """(r0, r1) = (layer_id / (num_layers - 1), 1 - layer_id / num_layers), r0 = 0 for one layer."""
    if not 0 <= layer_id < num_layers:
        raise ValueError(f"layer_id={layer_id} must be in [0, num_layers={num_layers})")
    return (layer_id / (num_layers - 1) if num_layers > 1 else 0.0), 1.0 - layer_id / num_layers


def orthogonal(key, shape, gain: float = 1.0):
    return jax.nn.initializers.orthogonal(scale=gain)(key, shape, jnp.float32)


def param(value, *names) -> nnx.Param:
    """A float32 parameter from a host (numpy) constant or an array, with its logical axes (none
    given: replicated, as the small per-channel vectors here are)."""
    value = jnp.asarray(value, jnp.float32)
    return nnx.Param(value, **axes(*(names or (None,) * value.ndim)))
