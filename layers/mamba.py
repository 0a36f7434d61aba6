"""Mamba (Mamba-1) mixer: Gu & Dao, 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", Section 3.4 and Figure 3, following the official `mamba_simple.Mamba` module:

    u, z = W_in x                                 (two branches of width Di = expand * d_model)
    u = SiLU(conv1d(u))                           causal depthwise convolution of width conv_size
    Δ_low, B_t, C_t = W_x u                       (dt_rank, N, N)
    Δ = softplus(W_dt Δ_low + dt_bias)            (Di,) per token
    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t,  y_t = C_t h_t + D ⊙ u_t    (kernels/selective_scan)
    out = W_out (y ⊙ SiLU(z))

Code name -> paper symbol: `in_proj` W_in, `conv` conv1d, `x_proj` the projection s_B, s_C and the
low-rank part of s_Δ, `dt_proj` Linear_dt (the up-projection of Δ from rank R = dt_rank), `dt_bias`
τ_Δ's bias (the official `dt_proj.bias`), `A_log` with A = -exp(A_log) (Di, N), `D` the skip D,
`out_proj` W_out; the decode state's `ssm` is h (B, Di, N) and `conv` the last conv_size - 1 conv
inputs (the official `conv_state`).

Initialisation as in the paper / official code: S4D-real A = -(1, ..., N) on every channel, D = 1,
W_dt ~ U(±dt_rank^-0.5), dt_bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] and
floored at dt_init_floor, so that Δ starts in that range.

Departures, all named: `dt_bias` is its own float32 parameter (the official one lives in dt_proj and
is added in float32 inside the CUDA kernel; same function); the linear layers use Flax's default
lecun-normal init instead of PyTorch's U(±1/sqrt(fan_in)) and the conv bias starts at zero instead
of PyTorch's uniform; `conv_size=0` drops the convolution (SiLU only). The layer's `mode` picks the
selective-scan form for the training path; "auto" (the default) is the form measured fastest on the
backend (on CPU the sequential scan; see kernels/selective_scan). `decode` runs `step` (one token,
`selective_scan_step`) for T = 1 and the "auto" form for a prefill of T > 1. `impl` ("auto",
"reference", "xla" or "pallas", see kernels/selective_scan) picks the op's implementation for the
training call and a multi-token decode; the single-token step is always the plain
`selective_scan_step` (the op has no impl there). impl="reference" runs the token-by-token scan
whatever the mode; impl="pallas" runs the Pallas kernels (mode and chunk_size then unused):
the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).

Option of Jamba (Lieber et al., 2024, arXiv 2403.19887; transformers' JambaMambaMixer): `inner_norms`
puts an RMSNorm with a weight (eps `norm_eps`) on each of Δ_low, B_t and C_t right after W_x, before
W_dt and the scan (`dt_norm`, `b_norm`, `c_norm`, the checkpoints' dt_layernorm, b_layernorm,
c_layernorm), which Jamba added to keep the activations of its larger models stable.
"""

import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import MODES, check_impl, check_mode
from kernels.selective_scan import selective_scan, selective_scan_step
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.norm import RMSNorm
from layers.options import Impl, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import ROWS, axes
from layers.state import state, stepwise


@state
class MambaState:
    ssm: Float[Array, "B Dm N"]  # (B, Dm, N) float32 SSM state h, Dm = Di = expand * d_model
    conv: Float[Array, "B W Dm"] | None  # (B, conv_size - 1, Di) last conv inputs; None when conv_size = 0


def inverse_softplus_dt(key, shape, dt_min: float, dt_max: float, dt_init_floor: float):
    """softplus^-1(dt) with dt log-uniform in [dt_min, dt_max], floored: the Δ bias init of the paper."""
    log_dt = jax.random.uniform(key, shape, jnp.float32, math.log(dt_min), math.log(dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), dt_init_floor)
    return dt + jnp.log(-jnp.expm1(-dt))


class Mamba(SequenceMixer):
    """Mamba (Gu & Dao 2023): selective SSM with input-dependent Δ, B, C (state_size N, inner width expand * d_model, a
    causal conv of conv_size taps, Δ through a dt_rank projection, "auto" = ceil(d_model / 16), initialised log-uniform
    in [dt_min, dt_max], at least dt_init_floor); mode picks the exact scan, auto the fastest for the backend (recurrent
    on CPU), chunk_size the chunk form's chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's
    implementation on every path; inner_norms: an RMSNorm (eps norm_eps) on each of Δ_low, B and C after x_proj
    (Jamba); dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, state_size: PosInt = 16, expand: PosInt = 2, conv_size: NonNegInt = 4,
                 dt_rank: PosInt | Annotated[str, OneOf("auto")] = "auto", dt_min: PosFloat = 0.001,
                 dt_max: PosFloat = 0.1, dt_init_floor: PosFloat = 1e-4,
                 mode: Annotated[str, OneOf("auto", *MODES)] = "auto", chunk_size: PosInt = 64, impl: Impl = "auto",
                 inner_norms: bool = False, norm_eps: PosFloat = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
        if d_model < 1 or state_size < 1 or expand < 1:
            raise ValueError(f"Mamba: d_model={d_model}, state_size={state_size} and expand={expand} must be >= 1")
        if dt_rank == "auto":
            dt_rank = math.ceil(d_model / 16)
        if not isinstance(dt_rank, int) or dt_rank < 1:
            raise ValueError(f"Mamba: dt_rank={dt_rank!r} must be 'auto' or a positive int")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"Mamba: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        if conv_size < 0:
            raise ValueError(f"Mamba: conv_size={conv_size} must be >= 0 (0 = no convolution)")
        check_mode(mode, chunk_size, "Mamba", ("auto", *MODES))
        check_impl(impl, "Mamba")
        Di, N, R = expand * d_model, state_size, dt_rank
        self.d_model, self.d_inner, self.state_size, self.dt_rank = d_model, Di, N, R
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype

        def linear(i, o, names, **kw):
            return Linear(i, o, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                              kernel_metadata=axes(*names), **kw)

        # The inner channels split over `tensor`; in_proj's output fuses [u, z], so it stays whole there.
        self.in_proj = linear(d_model, 2 * Di, ("embed", None))
        self.conv = ShortConvolution(Di, conv_size, use_bias=True, rngs=rngs) if conv_size else None
        self.x_proj = linear(Di, R + 2 * N, ("heads", None))
        std = R ** -0.5
        self.dt_proj = linear(R, Di, (None, "heads"),
                              kernel_init=lambda key, shape, dt: jax.random.uniform(key, shape, dt, -std, std))
        self.dt_bias = nnx.Param(inverse_softplus_dt(rngs.params(), (Di,), dt_min, dt_max, dt_init_floor),
                                 **axes("heads"))
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.float32), (Di, N))),
                               **axes("heads", None))
        self.D = nnx.Param(jnp.ones((Di,), jnp.float32), **axes("heads"))
        self.out_proj = linear(Di, d_model, ROWS)
        self.dt_norm, self.b_norm, self.c_norm = (RMSNorm(n, eps=norm_eps) for n in (R, N, N)) if inner_norms \
            else (None, None, None)

    step_mode, prefill_mode = "step", "auto"  # decode: `step` for one token and steps=True

    def init_state(self, batch_size: int, max_len: int = 0) -> MambaState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        conv = self.conv.init_state(batch_size, self.dtype) if self.conv is not None else None
        return MambaState(jnp.zeros((batch_size, self.d_inner, self.state_size), jnp.float32), conv)

    def _mix(self, x, state: MambaState, segment_ids, mode, steps: bool):
        """`mode` "step": `step` on the one token, or token by token with steps=True; else a selective-scan form."""
        N, R = self.state_size, self.dt_rank
        x = x.astype(self.dtype)
        u, z = jnp.split(self.in_proj(x), 2, axis=-1)  # (B, T, Di) each
        if self.conv is not None:
            u, conv = self.conv.decode(u, state.conv, segment_ids=segment_ids, steps=steps)
        else:
            u, conv = jax.nn.silu(u), None
        dt_low, B, C = jnp.split(self.x_proj(u), [R, R + N], axis=-1)  # (B, T, R), (B, T, N), (B, T, N)
        if self.dt_norm is not None:
            dt_low, B, C = self.dt_norm(dt_low), self.b_norm(B), self.c_norm(C)
        delta = jax.nn.softplus(self.dt_proj(dt_low).astype(jnp.float32) + self.dt_bias[...])  # (B, T, Di)
        A = -jnp.exp(self.A_log[...])  # (Di, N)
        if mode == "step":
            def step(h, u, delta, B, C):  # on 1-token slices (B, 1, ...)
                h, y = self.step(h, u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0])
                return y[:, None].astype(u.dtype), h  # (B, 1, Di)

            args = (state.ssm, u, delta, B, C)
            y, ssm = stepwise(step, *args) if steps else step(*args)
        else:
            y, ssm = selective_scan(u, delta, A, B, C, self.D[...], segment_ids=segment_ids,
                                    initial_state=state.ssm, output_final_state=True, mode=mode,
                                    chunk_size=self.chunk_size, impl=self.impl)
        y = y * jax.nn.silu(z)
        return self.out_proj(y), (MambaState.stepped if steps else MambaState)(ssm, conv)

    def step(self, h: Float[Array, "B Dm N"], u: Float[Array, "B Dm"], delta: Float[Array, "B Dm"],
             A: Float[Array, "Dm N"], B: Float[Array, "B N"], C: Float[Array, "B N"]):
        """One token of the SSM, the core of the official `Mamba.step` (`decode` with T = 1 is the whole
        step: conv window, projections, gate). Returns (h_t, y_t) float32."""
        return selective_scan_step(h, u, delta, A, B, C, self.D[...])
