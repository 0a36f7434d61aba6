"""Mamba-3's MIMO SSM (reference.py's `mamba3_mimo_step`) as linear attention with a scalar decay,
exactly, by the same rewrite as trapezoid.py's SISO one, so it runs on the same chunked and quadratic
forms (kernels/ssd/chunk.py, parallel.py) and GLA's Pallas kernels, unchanged.

A rank-R update X B̄^T = Σ_r X_r B̄_r^T is R rank-one updates under one decay. So each token t becomes
R consecutive steps (t, 0), ..., (t, R - 1) of a sequence R times longer: step (t, r) has the key
k = w_t B̄_{t,r}, the value X_{t,r} = x_t ⊙ w_r, the query C̄_{t,r} and the log-decay Δ_t A_t at r = 0,
0 at r > 0 (the decay acts once per token), with w_t = γ_t + ν_t, ν_t = (1 - λ_{t+1}) Δ_{t+1}, the
trapezoid's two taps folded into one weight as in trapezoid.py. Causal linear attention over that
sequence gives at step (t, R') every earlier token in full, and of token t itself only its ranks
r <= R', with weight w_t; the recurrence wants all R ranks with weight γ_t. The difference is local to
the token, an R × R correction:

    Y_{t,R'} = LA_{(t,R')} + Σ_r G_{R'r} (C̄_{t,R'} · B̄_{t,r}) X_{t,r} + D X_{t,R'},
    G_{R'r} = γ_t [r > R'] - ν_t [r <= R']

(R = 1 is trapezoid.py's -ν_t (C̄_t · B̄_t) x_t). The carried second tap enters the initial state,
h_0' = h_0 + (1 - λ_0) Δ_0 X_{-1} B̄_{-1}^T. Documents: a start restarts at the token's step (t, 0)
only (kernels/segments.py's rule applied to the segment ids repeated R times), and ν is 0 before one.

chunk_size counts tokens, so a chunk holds chunk_size R steps (the official kernels run the same
block of chunk_size R rows and recommend chunk_size = 64 / R). Departure from the official TileLang
kernels: they form the intra-chunk (c R) × (c R) scores with the whole token block visible to each of
its R queries (a Kronecker mask) and subtract the shifted-γ term; here the causal mask hides the
token's later ranks and the correction above adds them back, so any scalar-decay linear-attention
form serves.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels import pallas_platform
from kernels.gla.pallas import gla_pallas
from kernels.gla.pallas_tpu import gla_pallas_tpu
from kernels.mamba3.parallel import scalar_gla_parallel
from kernels.mamba3.reference import Mamba3Carry, lift, rotate
from kernels.mamba3.trapezoid import cumulative_angle
from kernels.ssd.chunk import scalar_gla_chunk
from kernels.ssd.cpu import ssd_chunk_cpu


def ranks_as_steps(a: Float[Array, "B T H Mr *F"]) -> Float[Array, "B T*Mr H *F"]:
    """(B, T, H, R, ...) -> (B, T R, H, ...): token t's rank r at step t R + r."""
    a = jnp.moveaxis(a, 3, 2)  # (B, T, R, H, ...)
    return a.reshape(a.shape[0], -1, *a.shape[3:])  # (B, T R, H, ...)


def mamba3_mimo_rewrite(x: Float[Array, "B T H P"], dt: Float[Array, "B T H"], A: Float[Array, "B T H"],
                        lam: Float[Array, "B T H"], B: Float[Array, "B T H Mr N"], C: Float[Array, "B T H Mr N"],
                        theta: Float[Array, "B T H N//2"], x_proj: Float[Array, "H Mr P"],
                        D: Float[Array, " H"] | None, starts: Bool[Array, "B T"],
                        segment_ids: Int[Array, "B T"] | None, carry: Mamba3Carry, form: str, chunk_size: int):
    """float32 inputs; form: "chunk", "parallel" or "pallas". Returns Y (B, T, H, Mr, P) float32 and the
    final carry (b of shape (B, H, Mr, N))."""
    Bsz, T, H, R, N = B.shape
    angle = cumulative_angle(dt[..., None] * theta, starts, carry.angle)  # (B, T, H, N/2)
    per_rank = jnp.broadcast_to(angle[:, :, :, None], (Bsz, T, H, R, N // 2))  # one Θ for every rank
    b, c = rotate(B, per_rank), rotate(C, per_rank)  # (B, T, H, R, N)
    X = lift(x, x_proj)  # (B, T, H, R, P)
    nxt = jnp.pad((1 - lam[:, 1:]) * dt[:, 1:], ((0, 0), (0, 1), (0, 0)))  # ν_t from token t + 1
    nxt = jnp.where(jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))[..., None], 0.0, nxt)  # (B, T, H)
    gamma = lam * dt  # (B, T, H)
    k = b * (gamma + nxt)[..., None, None]  # (B, T, H, R, N)
    first = jnp.arange(R) == 0  # the step of each token that carries its decay and its document start
    g = ranks_as_steps(jnp.where(first, (dt * A)[..., None], 0.0))  # (B, T R, H)
    steps_start = (starts[..., None] & first).reshape(Bsz, T * R)  # (B, T R)
    tap = jnp.einsum("bhrp,bhrn->bhpn", lift(carry.x, x_proj), carry.b)  # X_{-1} B̄_{-1}^T
    h0 = carry.h + ((1 - lam[:, 0]) * dt[:, 0])[..., None, None] * tap  # (B, H, P, N)
    q, k, v = (ranks_as_steps(a) for a in (c, k, X))  # (B, T R, H, N or P)
    if form == "pallas":
        kernel = gla_pallas_tpu if pallas_platform() == "tpu" else gla_pallas
        seg = None if segment_ids is None else jnp.repeat(segment_ids, R, axis=1)  # (B, T R)
        o, S = kernel(q, k, v, g, scale=1.0, segment_ids=seg, initial_state=jnp.swapaxes(h0, 2, 3))
        o, h = o.astype(jnp.float32), jnp.swapaxes(S, 2, 3)  # GLA's state is (B, H, N, P)
    elif form == "chunk":
        o, h = scalar_gla_chunk(q, k, v, g, steps_start, h0, chunk_size * R)
    elif form == "cpu":  # the same algorithm through kernels/ssd's CPU kernels (a group per head)
        o, h = ssd_chunk_cpu(q, k, v, g, steps_start, h0, chunk_size * R)
    else:
        o, h = scalar_gla_parallel(q, k, v, g, steps_start, h0)
    o = jnp.moveaxis(o.reshape(Bsz, T, R, H, -1), 2, 3)  # (B, T, H, R, P)
    later = jnp.arange(R)[None, :] > jnp.arange(R)[:, None]  # (R', r): r > R', the ranks the causal mask hid
    coef = jnp.where(later, gamma[..., None, None], -nxt[..., None, None])  # (B, T, H, R', r)
    local = jnp.einsum("bthqn,bthrn->bthqr", c, b) * coef  # (B, T, H, R', r)
    y = o + jnp.einsum("bthqr,bthrp->bthqp", local, X)
    if D is not None:
        y = y + D[:, None, None] * X
    return y, Mamba3Carry(h, angle[:, -1], b[:, -1], x[:, -1])
