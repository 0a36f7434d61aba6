"""The RG-LRU as a parallel prefix scan (Blelloch, 1990; the associative form recurrentgemma also ships):

    h_t = ā_t ⊙ h_{t-1} + b_t,   ā_t = a_t (0 at a document start),
    b_t = m_t ⊙ i_t ⊙ x_t,       m_t = sqrt(1 - a_t²) (1 at a document start)
    (ā, b) ∘ (ā', b') = (ā ā', ā' b + b')        (associative; the earlier element on the left)

jax.lax.associative_scan evaluates every prefix in O(log T) depth and O(T Dm) memory. The initial state is
folded into the first input (b_0 += ā_0 h_0). A document start sets ā_t to exactly 0, so the prefix
product through it is 0 and nothing before it reaches later tokens: exact, not a masked approximation.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.rglru.reference import input_scale, log_decay


def _combine(earlier, later):
    a1, b1 = earlier
    a2, b2 = later
    return a1 * a2, a2 * b1 + b2


def rglru_parallel(x: Float[Array, "B T Dm"], gate_a: Float[Array, "B T Dm"], gate_x: Float[Array, "B T Dm"],
                   a_param: Float[Array, " Dm"], c: float, starts: Bool[Array, "B T"], h0: Float[Array, "B Dm"]):
    """The same function and final state as reference.rglru_recurrent (float32 inputs)."""
    log_a = log_decay(gate_a, a_param, c)  # (B, T, Dm)
    start = starts[..., None]  # (B, T, 1)
    decay = jnp.where(start, 0.0, jnp.exp(log_a))
    inputs = jnp.where(start, 1.0, input_scale(log_a)) * (gate_x * x)  # (B, T, Dm)
    inputs = inputs.at[:, 0].add(decay[:, 0] * h0)
    _, h = jax.lax.associative_scan(_combine, (decay, inputs), axis=1)  # (B, T, Dm)
    return h, h[:, -1]
