"""Low-rank factorization of a projection: W (In, Out) replaced by A (In, r) B (r, Out) from a truncated
SVD, plain (Eckart-Young: the best rank-r W in Frobenius norm) or activation-aware (SVD-LLM, Wang et al.
2025: the SVD of S^T W with S S^T = X^T X the calibration inputs' Hessian, so A B is the best rank-r
weight for the outputs X W, and the error ||X (W - A B)|| is exactly the discarded singular values' norm).

`Factored` stands in for the array inside an `nnx.Param`, as `Quantized` does: `project` multiplies by
x A then B, r (In + Out) multiply-adds a row instead of In Out; any other read gets A B.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.held import HeldMatrix


@dataclasses.dataclass(frozen=True)
class Factored(HeldMatrix):
    """A weight of logical `shape` (contraction axes, then output axes; `in_ndim` of them contracted)
    held as a (In, r) and b (r, Out)."""
    a: Float[Array, "In R"]
    b: Float[Array, "R Out"]
    shape: tuple[int, ...]
    in_ndim: int = 1

    @property
    def dtype(self):
        return self.a.dtype

    def matrix(self) -> jax.Array:
        return self.a @ self.b

    def astype(self, dtype) -> "Factored":
        return dataclasses.replace(self, a=self.a.astype(dtype), b=self.b.astype(dtype))

    def matmul(self, x: Float[Array, "M In"], **dot_kwargs) -> Float[Array, "M Out"]:
        return jax.lax.dot(jax.lax.dot(x, self.a.astype(x.dtype), **dot_kwargs), self.b.astype(x.dtype), **dot_kwargs)


jax.tree_util.register_dataclass(Factored, data_fields=["a", "b"], meta_fields=["shape", "in_ndim"])


def spectrum(w: Float[Array, "In Out"], h: Float[Array, "In In"] | None = None, damp: float = 1e-6) -> tuple:
    """(U, sigma, V^T, S) of w's SVD, or with `h` = X^T X of S^T w's (S = chol(h + damp mean(diag h) I),
    S None without h): sigma[r:]'s norm is the error of the rank-r factors (of w, or of the outputs X w)."""
    w32, s = w.astype(jnp.float32), None
    if h is not None:
        h = h.astype(jnp.float32)
        s = jnp.linalg.cholesky(h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(w.shape[0]))  # lower, h = S S^T
        w32 = s.T @ w32
    return (*jnp.linalg.svd(w32, full_matrices=False), s)


def truncate(svd: tuple, rank: int, dtype) -> tuple[Float[Array, "In R"], Float[Array, "R Out"]]:
    """(A, B) of rank `rank` from spectrum(...): singular values split evenly (sqrt to each), mapped back
    by S^-T when whitened."""
    u, sigma, vt, s = svd
    root = jnp.sqrt(sigma[:rank])
    a, b = u[:, :rank] * root, root[:, None] * vt[:rank]
    if s is not None:
        a = jax.scipy.linalg.solve_triangular(s.T, a, lower=False)  # S^-T (U_r sqrt(Sigma_r))
    return a.astype(dtype), b.astype(dtype)


def factorize(w: Float[Array, "In Out"], rank: int, h: Float[Array, "In In"] | None = None, damp: float = 1e-6
              ) -> tuple[Float[Array, "In R"], Float[Array, "R Out"]]:
    """(A, B) of rank `rank` with A B ~ w: the truncated SVD of w, or with `h` = X^T X that of S^T w."""
    In, Out = w.shape
    if not 1 <= rank <= min(In, Out):
        raise ValueError(f"factorize: rank={rank}; expected 1 to {min(In, Out)} for a weight {In} x {Out}")
    return truncate(spectrum(w, h, damp), rank, w.dtype)
