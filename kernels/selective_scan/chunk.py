"""Chunked selective scan (Mamba-1): exact, any T.

The sequence is cut into chunks of L tokens. Inside every chunk the recurrence of reference.py runs
from a zero state, all chunks at once (L sequential steps instead of T). The state entering each
chunk is then carried across chunks with one short scan, and its contribution is added in closed
form, because the decay from the chunk start to token t is a product of scalars per (d, n):

    h_t = h_t^local + P_t ⊙ h_in,    P_t[d, n] = Π_{s ≤ t in chunk} exp(Δ_s[d] A[d, n]) = exp(A[d, n] S_t[d])
    y_t = y_t^local + Σ_n C_t[n] P_t[d, n] h_in[d, n],    S_t = Σ_{s ≤ t in chunk} Δ_s
    h_in(next chunk) = P_L ⊙ h_in + h_L^local

Departure from the official CUDA kernel, which runs one sequential scan per 2048-token chunk and
carries the state across chunks in registers: here the chunks run side by side, which is what makes
the form faster than a plain scan under XLA. Document starts are exact: the local scan zeroes its
state there (reference rule), and P_t is masked to exactly 0 from the first start in the chunk on,
so the carried state never crosses a boundary. Padding to a multiple of L uses Δ = 0, x = B = C = 0:
decay 1 and input 0, so the padded steps leave the state unchanged.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kernels.selective_scan.reference import selective_scan_recurrent


def selective_scan_chunk(x: Float[Array, "B T Dm"], delta: Float[Array, "B T Dm"], A: Float[Array, "Dm N"],
                         B: Float[Array, "B T N"], C: Float[Array, "B T N"], D: Float[Array, " Dm"] | None,
                         starts: Bool[Array, "B T"], h0: Float[Array, "B Dm N"], chunk_size: int):
    Bsz, T, Dm = x.shape
    N = A.shape[1]
    L = min(chunk_size, T)  # a short call pads no further than T
    nC = -(-T // L)
    pad = nC * L - T

    def chunks(a):  # (B, T, ...) -> (B, nC, L, ...)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(Bsz, nC, L, *a.shape[2:])

    x, delta, B, C, starts = map(chunks, (x, delta, B, C, starts))

    # Every chunk from a zero state, all chunks as one batch of B * nC sequences of length L.
    flat = lambda a: a.reshape(Bsz * nC, L, *a.shape[3:])
    y_local, h_local = selective_scan_recurrent(
        flat(x), flat(delta), A, flat(B), flat(C), D, flat(starts), jnp.zeros((Bsz * nC, Dm, N), jnp.float32))
    y_local = y_local.reshape(Bsz, nC, L, Dm)
    h_local = h_local.reshape(Bsz, nC, Dm, N)

    # Decay from the chunk start to t, exactly 0 once a document has started in this chunk.
    S = jnp.cumsum(delta, axis=2)  # (B, nC, L, Dm)
    alive = jnp.cumsum(starts, axis=2) == 0  # (B, nC, L)
    P = jnp.where(alive[..., None, None], jnp.exp(S[..., None] * A), 0.0)  # (B, nC, L, Dm, N)

    def carry(h, inputs):  # state entering each chunk
        decay, local = inputs
        return decay * h + local, h

    h_final, h_in = jax.lax.scan(carry, h0, (jnp.moveaxis(P[:, :, -1], 1, 0), jnp.moveaxis(h_local, 1, 0)))
    h_in = jnp.moveaxis(h_in, 0, 1)  # (B, nC, Dm, N)
    y = y_local + jnp.einsum("bcldn,bcln,bcdn->bcld", P, C, h_in)  # (B, nC, L, Dm)
    return y.reshape(Bsz, nC * L, Dm)[:, :T], h_final
