"""State space duality (SSD) of Mamba-2 (Dao & Gu, 2024, "Transformers are SSMs: Generalized Models
and Efficient Algorithms Through Structured State Space Duality", Section 3 and eq. 16): a selective
SSM whose decay is one scalar per head and step,

    h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t^T        h_t ∈ R^{P × N} per head
    y_t = h_t C_t + D_h x_t

written here token by token in float32: the truth for chunk.py and parallel.py.

Code name -> paper symbol: x -> x (B, T, H, P), dt -> Δ (B, T, H), already positive (the caller
applies softplus(dt + dt_bias)), A -> A (H,) negative (the scalar a_t = exp(Δ_t A) of the paper),
B, C -> B, C (B, T, G, N) shared by the H / G consecutive heads of each group (the paper's
"multi-value" / grouped pattern: head h reads group h // (H / G), as in the official code),
D -> D (H,), h -> the state (B, H, P, N), the official `ssm_state`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def heads_from_groups(B: Float[Array, "... G N"], num_heads: int) -> Float[Array, "... H N"]:
    """Repeat each group's B or C over its H / G consecutive heads."""
    return jnp.repeat(B, num_heads // B.shape[-2], axis=-2)


def ssd_step(h: Float[Array, "B H P N"], x: Float[Array, "B H P"], dt: Float[Array, "B H"], A: Float[Array, " H"],
             B: Float[Array, "B G N"], C: Float[Array, "B G N"], D: Float[Array, " H"] | None = None):
    """One token: returns (h_t, y_t) in float32. Used by the scan below and by decoding."""
    f32 = jnp.float32
    H = x.shape[1]
    x, dt = x.astype(f32), dt.astype(f32)
    B, C = heads_from_groups(B.astype(f32), H), heads_from_groups(C.astype(f32), H)  # (B, H, N)
    decay = jnp.exp(dt * A.astype(f32))  # (B, H)
    h = decay[:, :, None, None] * h + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]  # (B, H, P, N)
    y = jnp.einsum("bhpn,bhn->bhp", h, C)  # (B, H, P)
    if D is not None:
        y = y + D.astype(f32)[:, None] * x
    return h, y


def ssd_recurrent(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, " H"],
                  B: Float[Array, "B T G N"], C: Float[Array, "B T G N"], D: Float[Array, " H"] | None,
                  starts: Bool[Array, "B T"], h0: Float[Array, "B H P N"]):
    """Sequential lax.scan over time; the state is zeroed before the update at a document start.
    Returns y (B, T, H, P) float32 and the final state (B, H, P, N) float32."""

    def step(h, inputs):
        x_t, dt_t, B_t, C_t, start_t = inputs
        h = jnp.where(start_t[:, None, None, None], 0.0, h)
        return ssd_step(h, x_t, dt_t, A, B_t, C_t, D)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, dt, B, C, starts)]
    h, y = jax.lax.scan(step, h0.astype(jnp.float32), time_major)
    return jnp.moveaxis(y, 0, 1), h
