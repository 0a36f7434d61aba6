"""The SISO SSM of Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao & Gu, 2026, "Mamba-3: Improved
Sequence Modeling using State Space Principles", arXiv:2603.15569), token by token in float32: the
truth for trapezoid.py. Per head, with h_t ∈ R^{P × N}:

    Θ_t = Θ_{t-1} + Δ_t θ_t                              cumulative rotation angles (N / 2 of them)
    B̄_t = R(Θ_t) B_t,   C̄_t = R(Θ_t) C_t                  the complex state as rotary ("the RoPE trick")
    α_t = exp(Δ_t A_t),  β_t = (1 - λ_t) Δ_t α_t,  γ_t = λ_t Δ_t        exponential-trapezoidal rule
    h_t = α_t h_{t-1} + β_t x_{t-1} B̄_{t-1}^T + γ_t x_t B̄_t^T
    y_t = h_t C̄_t + D x_t

R(Θ) rotates the pairs (n, n + N/2) of channels by the angles Θ (the rotate-half layout of
layers/rotary.py); λ_t = 1/2 is the classical trapezoidal rule, λ_t = 1 Mamba-2's exponential-Euler.

Code name -> paper symbol: x -> x (B, T, H, P), dt -> Δ (B, T, H) > 0, A -> A_t (B, T, H) < 0 (a
scalar per head and token), lam -> λ (B, T, H) in [0, 1], B, C -> B, C (B, T, H, N), theta -> θ
(B, T, H, N/2), D -> D (H,). The carried state (`Mamba3Carry`) is everything the recurrence needs:
h, the angles Θ, and the second tap's factors B̄_{t-1} and x_{t-1} (the official `angle_dt_state`,
`ssm_state`, `k_state`, `v_state`). At a document start all four restart from zero, so the first
token of a document has no previous-token term.

The angles are kept in [0, 2π) (Θ mod 2π, as the official kernels do), so a long decode keeps their
precision; the rotations are unchanged by it.

MIMO (multi-input multi-output, the paper's rank-R variant; the official is_mimo=True): each token
brings R inputs and reads R outputs per head. x_t (P,) is lifted to X_t ∈ R^{P × R}, column r being
x_t ⊙ w_r with a learned w (H, R, P) per head (the official `mimo_x`), B_t, C_t become N × R (R
columns B_{t,r}, C_{t,r}, each rotated by the same Θ_t), and the rank-one update becomes rank R:

    h_t = α_t h_{t-1} + β_t X_{t-1} B̄_{t-1}^T + γ_t X_t B̄_t^T      (X B̄^T = Σ_r X_{:,r} B̄_r^T)
    Y_t = h_t C̄_t + D X_t                                          Y_t ∈ R^{P × R}: R outputs

with the same α, β, γ, Θ (one Δ, A_t, λ per head and token). The caller mixes the R outputs back
(layers/mamba3.py). The carry keeps x_{t-1} unlifted (B, H, P) and B̄_{t-1} as (B, H, R, N): the
state grows only by the (R - 1) N extra columns of B̄, as the official `k_state` does.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


class Mamba3Carry(NamedTuple):
    """The recurrent state of the op, float32."""
    h: Float[Array, "B H P N"]  # SSM state h
    angle: Float[Array, "B H N//2"]  # cumulative angles Θ, in [0, 2π)
    b: Float[Array, "B H *Mr N"]  # the previous token's rotated B̄_{t-1}: (B, H, N), or (B, H, Mr, N) for MIMO
    x: Float[Array, "B H P"]  # the previous token's x_{t-1}


def zero_carry(batch: int, heads: int, head_dim: int, state_size: int, mimo_rank: int = 0) -> Mamba3Carry:
    """mimo_rank 0: SISO's carry; R >= 1: MIMO's, B̄_{t-1} of shape (B, H, R, N)."""
    z = lambda *shape: jnp.zeros(shape, jnp.float32)
    rank = (mimo_rank,) if mimo_rank else ()
    return Mamba3Carry(z(batch, heads, head_dim, state_size), z(batch, heads, state_size // 2),
                       z(batch, heads, *rank, state_size), z(batch, heads, head_dim))


def wrap_angle(angle: Float[Array, "*S"]) -> Float[Array, "*S"]:
    """angle mod 2π, in [0, 2π); the gradient passes unchanged."""
    return angle - 2 * math.pi * jnp.floor(angle / (2 * math.pi))


def rotate(v: Float[Array, "*S N"], angle: Float[Array, "*S N//2"]) -> Float[Array, "*S N"]:
    """R(Θ) v: the pairs (v_n, v_{n + N/2}) rotated by Θ_n."""
    v1, v2 = jnp.split(v, 2, axis=-1)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([v1 * cos - v2 * sin, v1 * sin + v2 * cos], axis=-1)


def mamba3_step(carry: Mamba3Carry, x: Float[Array, "B H P"], dt: Float[Array, "B H"], A: Float[Array, "B H"],
                lam: Float[Array, "B H"], B: Float[Array, "B H N"], C: Float[Array, "B H N"],
                theta: Float[Array, "B H N//2"], D: Float[Array, " H"] | None = None):
    """One token of the recurrence above: returns (carry after it, y_t (B, H, P)), float32. Used by the
    scan below and by decoding."""
    f32 = jnp.float32
    x, dt, A, lam, B, C, theta = (a.astype(f32) for a in (x, dt, A, lam, B, C, theta))
    angle = wrap_angle(carry.angle + dt[..., None] * theta)  # (B, H, N/2)
    b, c = rotate(B, angle), rotate(C, angle)  # (B, H, N)
    alpha = jnp.exp(dt * A)
    beta, gamma = (1 - lam) * dt * alpha, lam * dt  # (B, H)
    outer = lambda x, b: x[..., :, None] * b[..., None, :]  # (B, H, P, N)
    h = (alpha[..., None, None] * carry.h + beta[..., None, None] * outer(carry.x, carry.b)
         + gamma[..., None, None] * outer(x, b))
    y = jnp.einsum("bhpn,bhn->bhp", h, c)
    if D is not None:
        y = y + D.astype(f32)[:, None] * x
    return Mamba3Carry(h, angle, b, x), y


def mamba3_recurrent(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
                     lam: Float[Array, "B T H"], B: Float[Array, "B T H N"], C: Float[Array, "B T H N"],
                     theta: Float[Array, "B T H N//2"], D: Float[Array, " H"] | None,
                     starts: Bool[Array, "B T"], carry: Mamba3Carry):
    """Sequential lax.scan over time; the carry is zeroed before the update at a document start.
    Returns y (B, T, H, P) float32 and the final carry."""

    def step(carry, inputs):
        *token, start = inputs
        carry = jax.tree.map(lambda a: jnp.where(start.reshape(-1, *(1,) * (a.ndim - 1)), 0.0, a), carry)
        return mamba3_step(carry, *token, D)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, dt, A, lam, B, C, theta, starts)]
    carry, y = jax.lax.scan(step, Mamba3Carry(*(a.astype(jnp.float32) for a in carry)), time_major)
    return jnp.moveaxis(y, 0, 1), carry


def lift(x: Float[Array, "*S H P"], x_proj: Float[Array, "H Mr P"]) -> Float[Array, "*S H Mr P"]:
    """X = x ⊙ w_r for each rank r: MIMO's R inputs from one x per head."""
    return x[..., None, :] * x_proj


def mamba3_mimo_step(carry: Mamba3Carry, x: Float[Array, "B H P"], dt: Float[Array, "B H"], A: Float[Array, "B H"],
                     lam: Float[Array, "B H"], B: Float[Array, "B H Mr N"], C: Float[Array, "B H Mr N"],
                     theta: Float[Array, "B H N//2"], x_proj: Float[Array, "H Mr P"],
                     D: Float[Array, " H"] | None = None):
    """One token of the MIMO recurrence (module docstring): returns (carry after it, Y_t (B, H, Mr, P)),
    float32; the carry's b is (B, H, Mr, N)."""
    f32 = jnp.float32
    x, dt, A, lam, B, C, theta, x_proj = (a.astype(f32) for a in (x, dt, A, lam, B, C, theta, x_proj))
    angle = wrap_angle(carry.angle + dt[..., None] * theta)  # (B, H, N/2)
    per_rank = jnp.broadcast_to(angle[:, :, None], (*B.shape[:-1], angle.shape[-1]))  # (B, H, Mr, N/2)
    b, c = rotate(B, per_rank), rotate(C, per_rank)  # (B, H, Mr, N): one Θ for every rank
    alpha = jnp.exp(dt * A)
    beta, gamma = (1 - lam) * dt * alpha, lam * dt  # (B, H)
    X, X_prev = lift(x, x_proj), lift(carry.x, x_proj)  # (B, H, Mr, P)
    rank_r = lambda X, b: jnp.einsum("bhrp,bhrn->bhpn", X, b)  # X B̄^T = Σ_r X_r B̄_r^T, (B, H, P, N)
    h = (alpha[..., None, None] * carry.h + beta[..., None, None] * rank_r(X_prev, carry.b)
         + gamma[..., None, None] * rank_r(X, b))
    y = jnp.einsum("bhpn,bhrn->bhrp", h, c)  # (B, H, Mr, P): one output per column of C̄
    if D is not None:
        y = y + D.astype(f32)[:, None, None] * X
    return Mamba3Carry(h, angle, b, x), y


def mamba3_mimo_recurrent(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
                          lam: Float[Array, "B T H"], B: Float[Array, "B T H Mr N"], C: Float[Array, "B T H Mr N"],
                          theta: Float[Array, "B T H N//2"], x_proj: Float[Array, "H Mr P"],
                          D: Float[Array, " H"] | None, starts: Bool[Array, "B T"], carry: Mamba3Carry):
    """mamba3_recurrent for MIMO: Y (B, T, H, Mr, P) float32 and the final carry."""

    def step(carry, inputs):
        *token, start = inputs
        carry = jax.tree.map(lambda a: jnp.where(start.reshape(-1, *(1,) * (a.ndim - 1)), 0.0, a), carry)
        return mamba3_mimo_step(carry, *token, x_proj, D)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, dt, A, lam, B, C, theta, starts)]
    carry, y = jax.lax.scan(step, Mamba3Carry(*(a.astype(jnp.float32) for a in carry)), time_major)
    return jnp.moveaxis(y, 0, 1), carry
