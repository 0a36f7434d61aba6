"""MesaNet's layer (von Oswald et al. 2025, "MesaNet: Sequence Modeling by Locally Optimal Test-Time
Training", arXiv 2506.05233), token by token in float32: the truth for the other forms.

Per head, the output is the prediction of the ridge regression of the values on the keys seen so far,
discounted by the forget gates and weighted by the input gates:

    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T          (K, K)
    G_t = gamma_t G_{t-1} + beta_t k_t v_t^T          (K, V)
    o_t = G_t^T (H_t + diag(lambda))^{-1} q_t

with gamma_t = exp(g_t) per head and lambda > 0 per key channel. The solve is `cg_steps` iterations of
conjugate gradients from x_0 = 0, exactly as written below (with flash-linear-attention's 1e-5 in both
denominators), so a finite iteration count is part of the function and every form runs the same
iterations: a form differs from this one only in how it applies A_t = H_t + diag(lambda) to a vector.

    r_0 = q_t, p_0 = r_0, x_0 = 0;  for i < cg_steps:
        a = A_t p_i;  alpha = |r_i|^2 / (p_i . a + 1e-5);  x += alpha p_i;  r_{i+1} = r_i - alpha a
        p_{i+1} = r_{i+1} + |r_{i+1}|^2 / (|r_i|^2 + 1e-5) p_i

Code names: `state` = (H, G) (B, H, K, K) and (B, H, K, V); `g` = log gamma_t <= 0 (B, T, H); `beta`
(B, T, H); `lamb` = lambda (H, K). Document starts (segment_ids) zero both H and G before the update;
token 0 continues `initial_state`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels.segments import entering_state, scan_documents

EPS = 1e-5  # flash-linear-attention's, in both CG denominators


def conjugate_gradients(apply_A, q: Float[Array, "*B K"], steps: int) -> Float[Array, "*B K"]:
    """`steps` iterations of CG for A x = q from x = 0 (module docstring); apply_A maps (*B, K) -> (*B, K)."""
    dot = lambda a, b: jnp.sum(a * b, axis=-1, keepdims=True)

    def body(_, carry):
        x, r, p, delta = carry
        a = apply_A(p)
        alpha = delta / (dot(p, a) + EPS)
        x, r = x + alpha * p, r - alpha * a
        new = dot(r, r)
        return x, r, r + new / (delta + EPS) * p, new

    x = jnp.zeros_like(q)
    return jax.lax.fori_loop(0, steps, body, (x, q, q, dot(q, q)))[0]


def mesa_step(state, q: Float[Array, "B H K"], k: Float[Array, "B H K"], v: Float[Array, "B H V"],
              g: Float[Array, "B H"], beta: Float[Array, "B H"], lamb: Float[Array, "H K"], cg_steps: int):
    """One token: returns (o_t (B, H, V), (H_t, G_t)), float32."""
    Hs, Gs = state
    decay, kb = jnp.exp(g)[..., None, None], (beta[..., None] * k)[..., :, None]
    Hs = decay * Hs + kb * k[..., None, :]
    Gs = decay * Gs + kb * v[..., None, :]
    x = conjugate_gradients(lambda p: jnp.einsum("bhij,bhi->bhj", Hs, p) + lamb * p, q, cg_steps)  # H^T p: as GLA
    return jnp.einsum("bhk,bhkv->bhv", x, Gs), (Hs, Gs)


def mesa_reference(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                   g: Float[Array, "B T H"], beta: Float[Array, "B T H"], lamb: Float[Array, "H K"], *,
                   cg_steps: int, segment_ids: Int[Array, "B T"] | None = None, initial_state: tuple | None = None):
    """Scan of `mesa_step` over time. Returns (o (B, T, H, V) in q's dtype, (H_T, G_T) float32)."""
    B, T, H, K = q.shape
    shapes = ((B, H, K, K), (B, H, K, v.shape[-1]))
    state = tuple(entering_state(None if initial_state is None else s0, shape)
                  for s0, shape in zip(initial_state or (None, None), shapes))
    lamb = lamb.astype(jnp.float32)
    step = lambda S, *x: mesa_step(S, *x, lamb, cg_steps)
    o, state = scan_documents(step, state, tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta)), segment_ids)
    return o.astype(q.dtype), state
