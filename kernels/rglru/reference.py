"""The RG-LRU, the Real-Gated Linear Recurrent Unit of Hawk and Griffin (De et al., 2024, "Griffin: Mixing
Gated Linear Recurrences with Local Attention for Efficient Language Models", Section 2.4, eq. 1-6), token
by token in float32:

    r_t = σ(x_t W_a + b_a)                   recurrence gate   (given: gate_a)
    i_t = σ(x_t W_x + b_x)                   input gate        (given: gate_x)
    log a_t = -c r_t softplus(-Λ)            a_t = a^{c r_t},  a = σ(Λ),  c = 8
    h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t),        y_t = h_t

one independent scalar recurrence per channel (Dm channels, the paper's lru_width). At a document start
(recurrentgemma's `segment_pos == 0`) the previous state is dropped (a_t h_{t-1} -> 0) and the
multiplier sqrt(1 - a_t²) is replaced by 1, so a document's first token enters whole. This scan is the
truth the associative-scan form (parallel.py) is tested against.

Numerics: 1 - a_t² is formed as -expm1(2 log a_t), without the cancellation of 1 - exp(...)² when a_t is
near 1; its square root has the derivative of sqrt(max(·, 1/(4 · 1000²))), i.e. clipped at 1000, as
recurrentgemma clips it (sqrt's derivative is unbounded at 0, which a_t -> 1 reaches).

Code name -> paper symbol: x -> x_t (the RG-LRU's input, the conv output in the recurrent block), gate_a
-> r_t, gate_x -> i_t, a_param -> Λ (Dm,), c -> c, h -> h_t, starts -> the document starts (reset).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

SQRT_MAX_GRADIENT = 1000.0  # recurrentgemma's bound on d sqrt(u) / du (it keeps bfloat16 training free of NaNs)


@jax.custom_jvp
def bounded_sqrt(u: Float[Array, "..."]) -> Float[Array, "..."]:
    """sqrt(u), u >= 0, whose derivative is taken at max(u, 1 / (4 SQRT_MAX_GRADIENT²)): at most SQRT_MAX_GRADIENT."""
    return jnp.sqrt(u)


@bounded_sqrt.defjvp
def _bounded_sqrt_jvp(primals, tangents):
    (u,), (du,) = primals, tangents
    floor = 1.0 / (4.0 * SQRT_MAX_GRADIENT ** 2)
    return jnp.sqrt(u), du * 0.5 * jax.lax.rsqrt(jnp.maximum(u, floor))


def log_decay(gate_a: Float[Array, "... Dm"], a_param: Float[Array, " Dm"], c: float) -> Float[Array, "... Dm"]:
    """log a_t = -c r_t softplus(-Λ) = c r_t log σ(Λ), float32."""
    return -c * gate_a * jax.nn.softplus(-a_param)


def input_scale(log_a: Float[Array, "... Dm"]) -> Float[Array, "... Dm"]:
    """sqrt(1 - a_t²) = sqrt(-expm1(2 log a_t)), float32, its derivative bounded (module docstring)."""
    return bounded_sqrt(-jnp.expm1(2.0 * log_a))


def rglru_step(h: Float[Array, "B Dm"], x: Float[Array, "B Dm"], gate_a: Float[Array, "B Dm"],
               gate_x: Float[Array, "B Dm"], a_param: Float[Array, " Dm"], c: float, start: Bool[Array, " B"]):
    """One token of the recurrence (float32 inputs): returns (h_t, y_t = h_t)."""
    log_a = log_decay(gate_a, a_param, c)  # (B, Dm)
    a = jnp.exp(log_a)
    multiplier = jnp.where(start[:, None], 1.0, input_scale(log_a))  # a document's first token enters whole
    h = jnp.where(start[:, None], 0.0, a * h) + multiplier * (gate_x * x)  # (B, Dm)
    return h, h


def rglru_recurrent(x: Float[Array, "B T Dm"], gate_a: Float[Array, "B T Dm"], gate_x: Float[Array, "B T Dm"],
                    a_param: Float[Array, " Dm"], c: float, starts: Bool[Array, "B T"], h0: Float[Array, "B Dm"]):
    """Sequential lax.scan over time (float32 inputs); `starts` marks the tokens that begin a document.
    Returns y (B, T, Dm) and the final state (B, Dm), float32."""

    def step(h, inputs):
        return rglru_step(h, *inputs[:3], a_param, c, inputs[3])

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, gate_a, gate_x, starts)]  # (T, B, ...)
    h, y = jax.lax.scan(step, h0, time_major)
    return jnp.moveaxis(y, 0, 1), h  # y: (T, B, Dm) -> (B, T, Dm)
