"""Mamba-3's SISO SSM (reference.py) as linear attention with one log-decay per head and token,
exactly, so it runs on the chunked and quadratic forms of that (chunk.py, parallel.py) and on GLA's
Pallas kernels in their scalar-gate mode.

The trapezoidal rule's second tap puts token s into the state twice: γ_s x_s B̄_s^T at step s, and
β_{s+1} x_s B̄_s^T = (1 - λ_{s+1}) Δ_{s+1} α_{s+1} x_s B̄_s^T at step s + 1, which then decays like
the first. So from step s + 1 on, token s enters with the one weight

    w_s = γ_s + ν_s,    ν_s = (1 - λ_{s+1}) Δ_{s+1}   (0 past the call's last token or at a document start)

as a single rank-one term x_s (w_s B̄_s)^T under the decay Π α: linear attention with a scalar
gate, q = C̄, k = w B̄, v = x, g = Δ A (the official kernels derive the same "shifted gamma"). Only at
step s itself does it hold too much, ν_s x_s B̄_s^T, so

    y_t = LA_t - ν_t (C̄_t · B̄_t) x_t + D x_t

The carried second tap enters through the initial state: h_0' = h_0 + (1 - λ_0) Δ_0 x_{-1} B̄_{-1}^T,
decayed by α_0 inside. The last token's ν is 0, so the final state is h_T itself, and no weight ever
crosses a document start (ν is 0 before one, the state restarts at one).

The angles Θ are a cumulative sum of Δ θ that restarts at each document start: an associative scan
(jax.lax.associative_scan) over (start, increment) pairs, then Θ mod 2π. Against the reference's
step-by-step sum this differs by rounding only (float32, about eps * |Θ| for the unwrapped sum).

Departure from the official Triton kernels: they fuse the rotation, the shifted weights and the
correction into one Mamba-3 kernel; here XLA forms them around the scalar-gate forms.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels import pallas_platform
from kernels.gla.pallas import gla_pallas
from kernels.gla.pallas_tpu import gla_pallas_tpu
from kernels.mamba3.parallel import scalar_gla_parallel
from kernels.mamba3.reference import Mamba3Carry, rotate, wrap_angle
from kernels.ssd.chunk import scalar_gla_chunk
from kernels.ssd.cpu import ssd_chunk_cpu


def cumulative_angle(increment: Float[Array, "B T H _M"], starts: Bool[Array, "B T"],
                     angle0: Float[Array, "B H _M"]) -> Float[Array, "B T H _M"]:
    """Θ_t = angle0 + Σ_{s <= t} increment_s within the carried document, Σ from the latest start on
    after one; mod 2π."""
    increment = increment.at[:, 0].add(angle0)

    def combine(a, b):  # (restarted, sum) of two adjacent spans: the later one's sum if it restarted
        (ra, va), (rb, vb) = a, b
        return ra | rb, jnp.where(rb[..., None, None], vb, va + vb)

    return wrap_angle(jax.lax.associative_scan(combine, (starts, increment), axis=1)[1])


def mamba3_trapezoid(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
                     lam: Float[Array, "B T H"], B: Float[Array, "B T H N"], C: Float[Array, "B T H N"],
                     theta: Float[Array, "B T H N//2"], D: Float[Array, " H"] | None,
                     starts: Bool[Array, "B T"], segment_ids: Int[Array, "B T"] | None, carry: Mamba3Carry,
                     form: str, chunk_size: int):
    """float32 inputs; form: "chunk", "cpu", "parallel" or "pallas". Returns y (B, T, H, P) float32 and the final
    carry."""
    angle = cumulative_angle(dt[..., None] * theta, starts, carry.angle)  # (B, T, H, N/2)
    b, c = rotate(B, angle), rotate(C, angle)  # (B, T, H, N)
    nxt = jnp.pad((1 - lam[:, 1:]) * dt[:, 1:], ((0, 0), (0, 1), (0, 0)))  # ν_s from token s + 1
    nxt = jnp.where(jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))[..., None], 0.0, nxt)  # (B, T, H)
    k = b * (lam * dt + nxt)[..., None]  # (B, T, H, N)
    g = dt * A  # (B, T, H)
    tap = ((1 - lam[:, 0]) * dt[:, 0])[..., None, None] * carry.x[..., :, None] * carry.b[..., None, :]
    h0 = carry.h + tap  # (B, H, P, N)
    if form == "pallas":
        kernel = gla_pallas_tpu if pallas_platform() == "tpu" else gla_pallas
        o, S = kernel(c, k, x, g, scale=1.0, segment_ids=segment_ids, initial_state=jnp.swapaxes(h0, 2, 3))
        o, h = o.astype(jnp.float32), jnp.swapaxes(S, 2, 3)  # GLA's state is (B, H, N, P)
    elif form == "chunk":
        o, h = scalar_gla_chunk(c, k, x, g, starts, h0, chunk_size)
    elif form == "cpu":  # the same algorithm through kernels/ssd's CPU kernels (a group per head)
        o, h = ssd_chunk_cpu(c, k, x, g, starts, h0, chunk_size)
    else:
        o, h = scalar_gla_parallel(c, k, x, g, starts, h0)
    skip = -nxt * jnp.sum(c * b, axis=-1)  # (B, T, H): the second tap counted too early
    if D is not None:
        skip = skip + D
    return o + skip[..., None] * x, Mamba3Carry(h, angle[:, -1], b[:, -1], x[:, -1])
