"""S4D, the diagonal linear time-invariant SSM (Gu, Gupta, Goel & Ré 2022, "On the Parameterization and
Initialization of Diagonal State Space Models", Sections 2-3), token by token in complex float32:

    continuous:  h'(t) = A h(t) + B u(t),  y(t) = C h(t) + D u(t),  A = diag(A_1..A_N) complex
    ZOH:         Ā = exp(Δ A),  B̄ = (Δ A)^{-1} (exp(Δ A) - I) Δ B = (exp(Δ A) - 1) / A · B
    recurrence:  h_t = Ā ⊙ h_{t-1} + B̄ u_t,   y_t = 2 Re(Σ_n C_n h_t[n]) + D u_t

one independent SSM per channel d (its own Δ_d, A_d, C_d; Dm channels). The state holds one of each
conjugate pair: N complex modes here stand for the paper's real state size 2N, and y = C h +
conj(C) conj(h) = 2 Re(C h), as in the official `S4DKernel`. B = 1 (the official s4d.py has no B:
it is fixed at its initial value 1 and C absorbs any scale). This scan is the truth the FFT form is
tested against.

Code name -> paper symbol: u -> u, A -> A (Dm, N), dt -> Δ (Dm,), C -> C (Dm, N), D -> D, h -> the
state x_t (the paper's x; h here as in the rest of the zoo), Abar/Bbar -> Ā/B̄.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Complex, Float


def discretize(A: Complex[Array, "Dm N"], dt: Float[Array, " Dm"]):
    """Zero-order hold with B = 1: (Ā, B̄), each (Dm, N) complex64."""
    dtA = dt.astype(jnp.float32)[:, None] * A.astype(jnp.complex64)  # (Dm, N)
    Abar = jnp.exp(dtA)
    return Abar, (Abar - 1) / A.astype(jnp.complex64)


def s4d_step(h: Complex[Array, "B Dm N"], u: Float[Array, "B Dm"], Abar: Complex[Array, "Dm N"],
             Bbar: Complex[Array, "Dm N"], C: Complex[Array, "Dm N"], D: Float[Array, " Dm"] | None = None):
    """One token: returns (h_t complex64, y_t float32). Used by the scan below and by decoding."""
    u = u.astype(jnp.float32)
    h = Abar * h + Bbar * u[:, :, None]  # (B, Dm, N)
    y = 2 * jnp.real(jnp.sum(C.astype(jnp.complex64) * h, axis=-1))  # (B, Dm)
    if D is not None:
        y = y + D.astype(jnp.float32) * u
    return h, y


def s4d_recurrent(u: Float[Array, "B T Dm"], A: Complex[Array, "Dm N"], dt: Float[Array, " Dm"],
                  C: Complex[Array, "Dm N"], D: Float[Array, " Dm"] | None, starts: Bool[Array, "B T"],
                  h0: Complex[Array, "B Dm N"]):
    """lax.scan over time; the state is zeroed before the update where `starts` marks a document start.
    Returns y (B, T, Dm) float32 and the final state (B, Dm, N) complex64."""
    Abar, Bbar = discretize(A, dt)

    def step(h, inputs):
        u_t, start_t = inputs
        h = jnp.where(start_t[:, None, None], 0, h)
        return s4d_step(h, u_t, Abar, Bbar, C, D)

    h, y = jax.lax.scan(step, h0.astype(jnp.complex64), (jnp.moveaxis(u, 1, 0), jnp.moveaxis(starts, 1, 0)))
    return jnp.moveaxis(y, 0, 1), h
