"""Selective scan of Mamba-1 (Gu & Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective
State Spaces", Algorithm 2 and eq. 2a-2b with the zero-order-hold discretisation of Section 3.5):

    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t B_t) x_t        h_t ∈ R^{Dm × N}
    y_t = C_t h_t + D x_t

per channel d: h_t[d, n] = exp(Δ_t[d] A[d, n]) h_{t-1}[d, n] + Δ_t[d] B_t[n] x_t[d],
y_t[d] = Σ_n C_t[n] h_t[d, n] + D[d] x_t[d]. This token-by-token float32 scan is the truth that
the chunked and associative forms are tested against.

Code name -> paper symbol: x -> x (the SSM input, u in the official code), delta -> Δ (already
positive), A -> A (Dm, N), B -> B_t, C -> C_t (shared by all channels, the paper's default), D -> D,
h -> h (the official `ssm_state`). The B_t Δ_t factor is the simplified "Euler" discretisation of
B that the paper and official kernels use (B̄ = Δ B rather than the exact ZOH (ΔA)^{-1}(exp(ΔA)-I)ΔB).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def selective_scan_step(h: Float[Array, "B Dm N"], x: Float[Array, "B Dm"], delta: Float[Array, "B Dm"],
                        A: Float[Array, "Dm N"], B: Float[Array, "B N"], C: Float[Array, "B N"],
                        D: Float[Array, " Dm"] | None = None):
    """One token: returns (h_t, y_t) in float32. Used by the scan below and by decoding."""
    f32 = jnp.float32
    x, delta, B, C = x.astype(f32), delta.astype(f32), B.astype(f32), C.astype(f32)
    decay = jnp.exp(delta[:, :, None] * A.astype(f32))  # (B, Dm, N) = exp(Δ_t A)
    h = decay * h + (delta * x)[:, :, None] * B[:, None, :]  # (B, Dm, N)
    y = jnp.einsum("bdn,bn->bd", h, C)  # (B, Dm)
    if D is not None:
        y = y + D.astype(f32) * x
    return h, y


def selective_scan_recurrent(x: Float[Array, "B T Dm"], delta: Float[Array, "B T Dm"], A: Float[Array, "Dm N"],
                             B: Float[Array, "B T N"], C: Float[Array, "B T N"], D: Float[Array, " Dm"] | None,
                             starts: Bool[Array, "B T"], h0: Float[Array, "B Dm N"]):
    """Sequential lax.scan over time. `starts` marks document starts: the state is zeroed before the
    update there. Returns y (B, T, Dm) float32 and the final state (B, Dm, N) float32."""

    def step(h, inputs):
        x_t, delta_t, B_t, C_t, start_t = inputs
        h = jnp.where(start_t[:, None, None], 0.0, h)
        return selective_scan_step(h, x_t, delta_t, A, B_t, C_t, D)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x, delta, B, C, starts)]
    h, y = jax.lax.scan(step, h0.astype(jnp.float32), time_major)
    return jnp.moveaxis(y, 0, 1), h
