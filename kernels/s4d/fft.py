"""S4D's convolution form: the SSM's output is the causal convolution of u with the kernel

    K_k = 2 Re(Σ_n C_n B̄_n Ā_n^k),   k = 0..T-1           (T, Dm), the paper's eq. (5)

applied by FFT (kernels/long_conv, O(T log T) per channel). The Vandermonde product over the powers
Ā^k = exp(k Δ A) is computed in blocks: with k = q R + r (R = ceil(sqrt(T))), Ā^k = (Ā^R)^q Ā^r, so
only (Dm, N, R + Q) exponentials are taken (the official `S4DKernel` takes all Dm N T) and the sum over
n becomes one batched matrix product per channel, (Q, N) @ (N, R); each power is a product of two
exponentials, exact to float32 rounding like exp(k Δ A) itself (no repeated products).

Continuing from a state h_0 (the state before token 0) and returning the final one, both exact:
unrolling h_t = Ā h_{t-1} + B̄ u_t gives

    h_t = Ā^{t+1} h_0 + Σ_{s<=t} Ā^{t-s} B̄ u_s
    y_t = (K * u)_t + D u_t + 2 Re(Σ_n C_n Ā_n^{t+1} h_0[n])      the state's contribution: the same
                                                                  blocked Vandermonde product, per row
    h_{T-1} = Ā^T h_0 + B̄ Σ_s Ā^{T-1-s} u_s                        the powers against u reversed in time

so a prefill (decoding T > 1 tokens) runs this form too; each term is computed only when asked for
(h_0 given, final state wanted).
"""

import math

import jax.numpy as jnp
from jaxtyping import Array, Complex, Float

from kernels.long_conv.fft import long_conv_fft
from kernels.s4d.reference import discretize


def _blocks(x, T: int, R: int):
    """(..., T) -> (..., Q, R), zero-padded to Q R: k = q R + r."""
    Q = -(-T // R)
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Q * R - T)]).reshape(*x.shape[:-1], Q, R)


def s4d_fft(u: Float[Array, "B T Dm"], A: Complex[Array, "Dm N"], dt: Float[Array, " Dm"],
            C: Complex[Array, "Dm N"], D: Float[Array, " Dm"] | None, h0: Complex[Array, "B Dm N"] | None,
            output_final_state: bool = True):
    """Returns y (B, T, Dm) float32 and the final state (B, Dm, N) complex64 (None unless asked for);
    h0 None is a zero state."""
    T = u.shape[1]
    R = math.isqrt(T - 1) + 1  # ceil(sqrt(T)) for T >= 1
    Q = -(-T // R)
    u = u.astype(jnp.float32)
    C = C.astype(jnp.complex64)
    Abar, Bbar = discretize(A, dt)
    dtA = dt.astype(jnp.float32)[:, None] * A.astype(jnp.complex64)  # (Dm, N)
    low = jnp.exp(dtA[..., None] * jnp.arange(R, dtype=jnp.float32))  # (Dm, N, R): Ā^r
    high = jnp.exp(dtA[..., None] * (R * jnp.arange(Q, dtype=jnp.float32)))  # (Dm, N, Q): Ā^{qR}
    K = jnp.einsum("dnq,dnr->dqr", high, (C * Bbar)[..., None] * low).reshape(-1, Q * R)[:, :T]  # (Dm, T)
    y = long_conv_fft(u, 2 * jnp.real(K).T)  # (B, T, Dm)
    if h0 is not None:
        x = (C * Abar * h0)[..., None] * high  # (B, Dm, N, Q)
        y0 = jnp.einsum("bdnq,dnr->bdqr", x, low).reshape(*x.shape[:2], Q * R)[..., :T]  # (B, Dm, T)
        y = y + 2 * jnp.swapaxes(jnp.real(y0), 1, 2)
    if D is not None:
        y = y + D.astype(jnp.float32) * u
    if not output_final_state:
        return y, None
    ur = _blocks(jnp.swapaxes(u[:, ::-1], 1, 2), T, R).astype(jnp.complex64)  # (B, Dm, Q, R): u_{T-1-k}
    h = Bbar * jnp.einsum("bdqr,dnr,dnq->bdn", ur, low, high)  # Σ_s Ā^{T-1-s} B̄ u_s
    if h0 is not None:
        h = h + jnp.exp(T * dtA) * h0
    return y, h
