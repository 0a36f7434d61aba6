"""Small linear-algebra helpers shared by the chunked ops."""

import jax.numpy as jnp
from jaxtyping import Array, Float


def unit_lower_inverse(A: Float[Array, "... C C"]) -> Float[Array, "... C C"]:
    """(I - A)^{-1} for strictly lower-triangular A, by blocks that double in size (as fla's
    solve_tril merges 16-blocks): with the inverses I11, I22 of two diagonal blocks known, the
    inverse of [[I - A11, 0], [-A21, I - A22]] is [[I11, 0], [I22 A21 I11, I22]]. Matmuls only, and
    exact in exact arithmetic. Used instead of jax.scipy.linalg.solve_triangular, whose LAPACK trsm
    on XLA:CPU deadlocked (jaxlib 0.10.2) when two ran at once on a 2-core machine, each waiting for
    the thread pool the other held (a training step of DeltaNet hung this way)."""
    lead, C = A.shape[:-2], A.shape[-1]
    P = 1 << (C - 1).bit_length()  # padded to a power of two; the padding block is the identity
    A = jnp.pad(A.reshape(-1, C, C), ((0, 0), (0, P - C), (0, P - C)))  # (Z, P, P)
    inv = jnp.ones((A.shape[0], P, 1, 1), A.dtype)  # (Z, P / b, b, b): inverses of the b x b blocks
    b = 1
    while b < P:
        nb = P // (2 * b)
        blocks = jnp.diagonal(A.reshape(-1, nb, 2 * b, nb, 2 * b), axis1=1, axis2=3)  # (Z, 2b, 2b, nb)
        a21 = jnp.moveaxis(blocks, -1, 1)[:, :, b:, :b]  # (Z, nb, b, b)
        i11, i22 = inv[:, 0::2], inv[:, 1::2]
        i21 = i22 @ a21 @ i11
        top = jnp.concatenate([i11, jnp.zeros_like(i11)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([i21, i22], axis=-1)], axis=-2)  # (Z, nb, 2b, 2b)
        b *= 2
    return inv[:, 0, :C, :C].reshape(lead + (C, C))
