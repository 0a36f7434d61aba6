"""Mamba-3 mixer, single-input single-output (mimo_rank=1) or MIMO (mimo_rank=R >= 2): Lahoti, Li, Chen,
Wang, Bick, Kolter, Dao & Gu, 2026, "Mamba-3: Improved Sequence Modeling using State Space Principles"
(arXiv:2603.15569), following the official `mamba_ssm.modules.mamba3.Mamba3` (is_mimo=False; with
mimo_rank >= 2, is_mimo=True). SISO:

    z, x, B, C, dt, a, l, φ = W_in u        widths Di, Di, G N, G N, H, H, H, M  (Di = expand * d_model)
    B, C = RMSNorm(B) + b_B, RMSNorm(C) + b_C       per group, then per head (the biases are per head)
    Δ = softplus(dt + dt_bias),  A_t = -max(f(a), A_floor),  λ = σ(l),  θ = π tanh(φ)   per token
    h_t = α_t h_{t-1} + β_t x_{t-1} B̄_{t-1}^T + γ_t x_t B̄_t^T,  y_t = h_t C̄_t + D x_t     (kernels/mamba3)
    out = W_out (y ⊙ SiLU(z))

with α = exp(Δ A), β = (1 - λ) Δ α, γ = λ Δ (the exponential-trapezoidal rule), B̄, C̄ = B, C rotated
by the cumulative angles Θ_t = Θ_{t-1} + Δ_t θ_t (the complex-valued state as data-dependent rotary),
f(a) = 1 + a for a >= 0 and 1 / (1 - a) below (the official "heavy-tail" activation), H = Di /
head_dim heads of width P = head_dim, G = num_groups groups of B, C, and M = state_size *
rope_fraction / 2 angles per token, shared by the heads (each scales them by its own Δ); the other
N/2 - M channel pairs are not rotated. There is no short convolution: the paper drops it, the
trapezoid's two taps and the B, C biases standing in for it.

MIMO (mimo_rank = R >= 2) changes only what enters and leaves the SSM, as the official is_mimo=True:

    z, x, B, C, dt, a, l, φ = W_in u        widths Di, Di, R G N, R G N, H, H, H, M    (B, C: (r g n))
    B_r, C_r = RMSNorm(B_r) + b_B,r, RMSNorm(C_r) + b_C,r      each rank r and group, biases (H, R, N)
    X_t = [x_t ⊙ w^x_r]_r ∈ R^{P × R}                            per head, w^x (H, R, P)
    h_t = α_t h_{t-1} + β_t X_{t-1} B̄_{t-1}^T + γ_t X_t B̄_t^T,  Y_t = h_t C̄_t + D X_t    (kernels/mamba3)
    y_t = Σ_r w^o_r ⊙ Y_{t,r} ⊙ SiLU(z_t ⊙ w^z_r),   out = W_out y

with B̄_t, C̄_t ∈ R^{N × R} (every column rotated by the same Θ_t), one Δ, A_t, λ, θ per head and token
as in SISO, and w^x, w^z, w^o initialised to 1/R, 1, 1/R. The state h stays (P, N); the update is rank R.

Code name -> paper symbol: `in_proj` W_in (the official order [z, x, B, C, dt, A, trap, angle]),
`dt_bias` Δ's bias, `A_floor` the floor of -A_t, `B_bias`, `C_bias` the B and C biases (H, N), init 1,
`B_norm`, `C_norm` the QK-norm-like RMSNorms of B and C (one weight of N, as the official), `D` the
skip D (H,), `out_proj` W_out. The decode state is the op's carry: `ssm` h (B, H, P, N), `angle` Θ
(B, H, N/2), `b` the last token's B̄ and `x` its x (the official `ssm_state`, `angle_dt_state`,
`k_state`, `v_state`), a fixed size; all four restart from zero at a document start. MIMO: `mimo_x`,
`mimo_z`, `mimo_o` w^x, w^z, w^o (H, R, P), `B_bias`, `C_bias` (H, R, N), and the state's `b` holds the
R columns of B̄ (B, H, R, N); x stays unlifted (B, H, P), as the official `k_state` and `v_state`.

Departures, all named: mimo_rank=1 means SISO (the official is_mimo=False, whatever mimo_rank says);
no output norm before the gate (the official is_outproj_norm, off by default there too); the rotation
pairs channel n with n + N/2 (layers/rotary.py's rotate-half layout), where the official SISO kernels
pair 2n with 2n + 1: a fixed permutation of B's and C's channels, so the same family of functions, but
official checkpoints would need their B, C columns, norm weights and biases permuted; the state
keeps x_{t-1} and B̄_{t-1} in float32 (the official in the model's dtype); the linear layers use
Flax's lecun-normal init instead of PyTorch's U(±1/sqrt(fan_in)). MIMO pairs channels n and n + N/2
exactly as the official MIMO kernels do (its rotate-half layout, unrotated pairs last), so only SISO
has the permutation above; MIMO's chunk_size counts tokens of R rank steps each (the official
recommends chunk_size = 64 / R; the default stays 64); no fused output norm (the official
fuse_pregate_headwise_norm, which needs is_outproj_norm). The training path's forms come from the op
(kernels/mamba3: a token-by-token scan, or the recurrence rewritten exactly as linear attention with
a scalar decay, in SSD's chunked or quadratic form or on GLA's Pallas kernels; MIMO's rewrite makes
each token R steps of it, kernels/mamba3/mimo.py); `decode` runs the op's single-token step
(`mamba3_step`, MIMO `mamba3_mimo_step`) for T = 1 and steps=True, the chunk form for T > 1.
"""

import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.mamba3 import Mamba3Carry, mamba3, mamba3_mimo, mamba3_mimo_step, mamba3_step, zero_carry
from kernels.ssd.reference import heads_from_groups
from layers.linear import Linear
from layers.mamba import inverse_softplus_dt
from layers.mamba2 import ssd_heads
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, Mode, PosFloat, PosInt, Range
from layers.sharding import ROWS, axes
from layers.state import state, stepwise


@state
class Mamba3State:
    ssm: Float[Array, "B H P N"]  # (B, H, P, N) float32 SSM state h
    angle: Float[Array, "B H N//2"]  # (B, H, N/2) float32 cumulative rotation angles Θ, in [0, 2π)
    b: Float[Array, "B H *Mr N"]  # (B, H, N) float32 the last token's rotated B̄ (the second tap); MIMO (B, H, Mr, N)
    x: Float[Array, "B H P"]  # (B, H, P) float32 the last token's x


def heavy_tail(a: Float[Array, "*S"]) -> Float[Array, "*S"]:
    """1 + a for a >= 0, 1 / (1 - a) below: positive, continuous and differentiable at 0."""
    return jnp.maximum(a, 0) + 1 / (1 - jnp.minimum(a, 0))


class Mamba3(SequenceMixer):
    """Mamba-3 (Lahoti et al. 2026), SISO: exponential-trapezoidal SSM with a complex (data-dependent rotary) state,
    data-dependent A_t, normed and biased B/C, no conv; heads of head_dim channels of the expand * d_model inner width,
    num_groups groups of state_size for B/C; rope_fraction: the share of the state's channels rotated; A_floor: the
    least decay rate -A_t; Δ initialised log-uniform in [dt_min, dt_max] (at least dt_init_floor); norm_eps: the B/C
    norms'; mode ("recurrent" | "chunk" | "parallel") picks the training path's exact form, chunk_size its chunk; impl
    ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path; mimo_rank: R, 1 for SISO,
    R >= 2 for MIMO (R inputs and outputs per head, rank-R state updates; chunk_size counts tokens, R rank steps
    each, the official recommends 64 / R); dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, state_size: PosInt = 128, expand: PosInt = 2, head_dim: PosInt = 64,
                 num_groups: PosInt = 1, rope_fraction: Annotated[float, Range(0, 1, lo_open=True)] = 0.5,
                 chunk_size: PosInt = 64, mode: Mode = "chunk", dt_min: PosFloat = 0.001, dt_max: PosFloat = 0.1,
                 dt_init_floor: PosFloat = 1e-4, A_floor: PosFloat = 1e-4, norm_eps: PosFloat = 1e-5,
                 mimo_rank: PosInt = 1, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        Di, H = ssd_heads("Mamba3", d_model, state_size, expand, head_dim, num_groups)
        M = int(state_size * rope_fraction) // 2
        if state_size % 2 or not 0 < rope_fraction <= 1 or M < 1:
            raise ValueError(f"Mamba3: need an even state_size and 0 < rope_fraction <= 1 rotating at least one "
                             f"channel pair, got state_size={state_size}, rope_fraction={rope_fraction}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"Mamba3: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        if A_floor <= 0:
            raise ValueError(f"Mamba3: A_floor={A_floor} must be > 0")
        check_mode(mode, chunk_size, "Mamba3")
        check_impl(impl, "Mamba3")
        if not isinstance(mimo_rank, int) or mimo_rank < 1:
            raise ValueError(f"Mamba3: mimo_rank={mimo_rank!r}; expected a positive int (1: SISO, >= 2: MIMO)")
        G, N, R = num_groups, state_size, mimo_rank
        self.d_model, self.d_inner, self.num_heads, self.head_dim = d_model, Di, H, head_dim
        self.num_groups, self.state_size, self.num_angles, self.A_floor, self.mimo_rank = G, N, M, A_floor, R
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype

        def linear(i, o, names):
            return Linear(i, o, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                          kernel_metadata=axes(*names))

        # in_proj's output fuses [z, x, B, C, dt, A, λ, θ]: a split over `tensor` would cut between the
        # quantities, so it stays whole there (the small per-head parameters are replicated).
        self.in_proj = linear(d_model, 2 * Di + 2 * R * G * N + 3 * H + M, ("embed", None))
        self.dt_bias = nnx.Param(inverse_softplus_dt(rngs.params(), (H,), dt_min, dt_max, dt_init_floor))
        rank = (R,) if R > 1 else ()  # MIMO's biases are per head and rank, (H, R, N)
        self.B_bias = nnx.Param(jnp.ones((H, *rank, N), jnp.float32), **axes(None, *rank and (None,), None))
        self.C_bias = nnx.Param(jnp.ones((H, *rank, N), jnp.float32), **axes(None, *rank and (None,), None))
        if R > 1:  # MIMO's per-head, per-rank channel weights (the official mimo_x, mimo_z, mimo_o and their init)
            per_rank = lambda v: nnx.Param(jnp.full((H, R, head_dim), v, jnp.float32), **axes(None, None, None))
            self.mimo_x, self.mimo_z, self.mimo_o = per_rank(1 / R), per_rank(1.0), per_rank(1 / R)
        self.B_norm, self.C_norm = RMSNorm(N, eps=norm_eps), RMSNorm(N, eps=norm_eps)
        self.D = nnx.Param(jnp.ones((H,), jnp.float32))
        self.out_proj = linear(Di, d_model, ROWS)

    step_mode = "step"  # decode: `mamba3_step` for one token and steps=True

    def init_state(self, batch_size: int, max_len: int = 0) -> Mamba3State:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        return Mamba3State(*zero_carry(batch_size, self.num_heads, self.head_dim, self.state_size,
                                       self.mimo_rank if self.mimo_rank > 1 else 0))

    def _mix(self, x, state: Mamba3State, segment_ids, mode, steps: bool):
        """`mode` "step": `mamba3_step` on the one token, or token by token with steps=True; else the op's form."""
        Bsz, T, _ = x.shape
        Di, H, P, G, N, M, R = (self.d_inner, self.num_heads, self.head_dim, self.num_groups, self.state_size,
                                self.num_angles, self.mimo_rank)
        f32 = jnp.float32
        x = x.astype(self.dtype)
        RGN = R * G * N
        cuts = [Di, 2 * Di, 2 * Di + RGN, 2 * Di + 2 * RGN, 2 * Di + 2 * RGN + H, 2 * Di + 2 * RGN + 2 * H,
                2 * Di + 2 * RGN + 3 * H]
        z, xs, B, C, dt, a, lam, theta = jnp.split(self.in_proj(x), cuts, axis=-1)
        xs = xs.reshape(Bsz, T, H, P)  # (B, T, H, P)
        if R == 1:
            B, C = (heads_from_groups(norm(v.reshape(Bsz, T, G, N)), H).astype(f32) + bias[...]  # (B, T, H, N)
                    for v, norm, bias in ((B, self.B_norm, self.B_bias), (C, self.C_norm, self.C_bias)))
        else:  # the official layout (r g n): rank outermost; one norm per rank and group
            B, C = (jnp.moveaxis(heads_from_groups(norm(v.reshape(Bsz, T, R, G, N)), H), 2, 3).astype(f32)
                    + bias[...] for v, norm, bias in ((B, self.B_norm, self.B_bias), (C, self.C_norm, self.C_bias)))
            # B, C: (B, T, H, R, N)
        dt = jax.nn.softplus(dt.astype(f32) + self.dt_bias[...])  # (B, T, H)
        A = -jnp.maximum(heavy_tail(a.astype(f32)), self.A_floor)  # (B, T, H)
        lam = jax.nn.sigmoid(lam.astype(f32))  # (B, T, H)
        theta = jnp.pad(math.pi * jnp.tanh(theta.astype(f32)), ((0, 0), (0, 0), (0, N // 2 - M)))  # (B, T, N/2)
        theta = jnp.broadcast_to(theta[:, :, None], (Bsz, T, H, N // 2))  # (B, T, H, N/2): one per head's Δ
        carry = Mamba3Carry(state.ssm, state.angle, state.b, state.x)
        mimo = (self.mimo_x[...],) if R > 1 else ()  # the op's extra argument x_proj
        step_op, op = (mamba3_mimo_step, mamba3_mimo) if R > 1 else (mamba3_step, mamba3)
        if mode == "step":
            def step(carry, *token):  # on 1-token slices (B, 1, ...)
                carry, y = step_op(carry, *(t[:, 0] for t in token), *mimo, self.D[...])
                return y[:, None].astype(xs.dtype), carry  # (B, 1, H, P), MIMO (B, 1, H, R, P)

            args = (carry, xs, dt, A, lam, B, C, theta)
            y, carry = stepwise(step, *args) if steps else step(*args)
        else:
            y, carry = op(xs, dt, A, lam, B, C, theta, *mimo, self.D[...], segment_ids=segment_ids,
                          initial_state=carry, output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                          impl=self.impl)
        if R == 1:
            y = (y.reshape(Bsz, T, Di).astype(f32) * jax.nn.silu(z.astype(f32))).astype(self.dtype)  # (B, T, Di)
        else:  # each rank's output gated by its own z ⊙ w_z, then mixed back by w_o: Σ_r w_o,r ⊙ y_r ⊙ SiLU(z ⊙ w_z,r)
            z = z.reshape(Bsz, T, H, 1, P).astype(f32) * self.mimo_z[...]  # (B, T, H, R, P)
            y = jnp.sum(y.astype(f32) * jax.nn.silu(z) * self.mimo_o[...], axis=3)  # (B, T, H, P)
            y = y.reshape(Bsz, T, Di).astype(self.dtype)  # (B, T, Di)
        return self.out_proj(y), (Mamba3State.stepped if steps else Mamba3State)(*carry)
