"""Mamba-2 mixer: Dao & Gu, 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", Section 7 ("the Mamba-2 block", Figure 6), following the
official `mamba_ssm.modules.mamba2.Mamba2`:

    z, xBC, dt = W_in x                          widths Di, Di + 2 G N, H  (Di = d_inner or expand * d_model)
    x, B, C = SiLU(conv1d(xBC))                  one causal depthwise conv over x, B and C together
    Δ = softplus(dt + dt_bias)                   (H,) per token: one scalar step per head
    h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t^T,  y_t = h_t C_t + D_h x_t      (kernels/ssd)
    out = W_out GatedRMSNorm(y, z)               (output_norm "none": W_out (y * SiLU(z)))

with H = Di / head_dim heads of width P = head_dim and G = num_groups groups of B, C shared by H / G
consecutive heads each.

Code name -> paper symbol: `in_proj` W_in (the official order [z, x, B, C, dt]), `conv` conv1d,
`dt_bias` Δ's bias, `A_log` with A = -exp(A_log) (H,), `D` the skip D (H,), `norm` the extra
normalisation before the output projection, `out_proj` W_out; the decode state's `ssm` is h
(B, H, P, N) and `conv` the last conv_size - 1 inputs of the conv (the official `conv_state`).

Initialisation as in the official code: A ~ U(A_init_range), D = 1, dt_bias = softplus^-1(dt) with dt
log-uniform in [dt_min, dt_max] and floored at dt_init_floor.

Departures, all named: by default the output norm is layers.norm.GatedRMSNorm, RMSNorm(y) * SiLU(z)
over all Di channels, where the official module normalises after gating, RMSNorm(y * SiLU(z)), and
per group of Di / G channels: `norm_before_gate=False` is the official form (what zoo.hf loads
checkpoints with), its eps `norm_eps`; `output_norm="grouped"` takes the statistics per group in either
order (Falcon-H1's gated norm, whose norm_before_gate is True by default) and "none" drops the norm, y *
SiLU(z) (Falcon-H1's mamba_rms_norm: false); `d_inner` gives the inner width outright where it is not a
multiple of d_model (Falcon-H1's mamba_d_ssm, Nemotron-H's mamba_num_heads x mamba_head_dim); no
`dt_limit` clamp, no learnable initial state, no `d_ssm` < Di partial SSM and no MLP branch in in_proj
(`d_mlp`); the linear layers use Flax's lecun-normal init instead of PyTorch's U(±1/sqrt(fan_in)) and
the conv bias starts at zero; `conv_size=0` drops the convolution (SiLU only). The layer's `mode` picks
the SSD form of the training path; `decode` runs `step` (`ssd_step`) for T = 1 and the chunked form for T > 1. `impl`
("auto", "reference", "xla" or "pallas", see kernels/ssd) picks the op's implementation for the
training call and a multi-token decode; the single-token step is always the plain `ssd_step` (the
op has no impl there). impl="reference" runs the token-by-token scan whatever the mode;
impl="pallas" runs the Pallas kernels, whose chunk is their own block size (mode and chunk_size then
unused): the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import check_impl, check_mode
from kernels.ssd import ssd, ssd_step
from layers.conv import ShortConvolution
from layers.linear import Linear
from layers.mamba import inverse_softplus_dt
from layers.mixer import SequenceMixer
from layers.norm import GatedRMSNorm
from layers.options import Impl, Mode, NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import ROWS, axes
from layers.state import state, stepwise


@state
class Mamba2State:
    ssm: Float[Array, "B H P N"]  # (B, H, P, N) float32 SSM state h
    conv: Float[Array, "B W _Dconv"] | None  # (B, conv_size - 1, Di + 2 G N) last conv inputs; None if conv_size = 0


def ssd_heads(where: str, d_model: int, state_size: int, expand: int, head_dim: int, num_groups: int,
              d_inner: int | None = None):
    """(inner width d_inner or expand * d_model, its number of heads of head_dim) of Mamba-2 and Mamba-3, refusing
    sizes that do not divide, naming `where`."""
    if min(d_model, state_size, expand, head_dim, num_groups, 1 if d_inner is None else d_inner) < 1:
        raise ValueError(f"{where}: d_model={d_model}, state_size={state_size}, expand={expand}, d_inner={d_inner}, "
                         f"head_dim={head_dim} and num_groups={num_groups} must be >= 1")
    Di = expand * d_model if d_inner is None else d_inner
    if Di % head_dim:
        raise ValueError(f"{where}: head_dim={head_dim} does not divide the inner width "
                         f"{'expand * d_model' if d_inner is None else 'd_inner'} = {Di}")
    H = Di // head_dim
    if H % num_groups:
        raise ValueError(f"{where}: num_groups={num_groups} does not divide num_heads = inner width / "
                         f"head_dim = {H}")
    return Di, H


class Mamba2(SequenceMixer):
    """Mamba-2 (Dao & Gu 2024): SSD with a scalar decay per head (heads of head_dim channels of the inner width, d_inner
    or None = expand * d_model, A from A_init_range) and grouped B/C (num_groups groups of state_size), a causal conv
    of conv_size taps, Δ initialised log-uniform in [dt_min, dt_max] (at least dt_init_floor); norm_before_gate: the
    output norm RMSNorm(y) * SiLU(z) (True) or the official RMSNorm(y * SiLU(z)) per group (False), with eps
    norm_eps; output_norm: "gated" that norm, "grouped" its statistics per group in either order (Falcon-H1), "none"
    no norm, y * SiLU(z); mode ("recurrent" | "chunk" | "parallel") picks the training path's exact form, chunk_size
    its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype: the
    compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, state_size: PosInt = 64, expand: PosInt = 2, head_dim: PosInt = 64,
                 num_groups: PosInt = 1, conv_size: NonNegInt = 4, chunk_size: PosInt = 64, mode: Mode = "chunk",
                 dt_min: PosFloat = 0.001, dt_max: PosFloat = 0.1, dt_init_floor: PosFloat = 1e-4,
                 A_init_range: tuple[PosFloat, PosFloat] = (1.0, 16.0), norm_before_gate: bool = True,
                 norm_eps: PosFloat = 1e-5, d_inner: PosInt | None = None,
                 output_norm: Annotated[str, OneOf("gated", "grouped", "none")] = "gated", impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        Di, H = ssd_heads("Mamba2", d_model, state_size, expand, head_dim, num_groups, d_inner)
        if output_norm not in ("gated", "grouped", "none"):
            raise ValueError(f"Mamba2: output_norm={output_norm!r}; expected 'gated', 'grouped' or 'none'")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"Mamba2: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        lo, hi = A_init_range
        if not 0 < lo <= hi:
            raise ValueError(f"Mamba2: A_init_range={A_init_range} must satisfy 0 < low <= high")
        if conv_size < 0:
            raise ValueError(f"Mamba2: conv_size={conv_size} must be >= 0 (0 = no convolution)")
        check_mode(mode, chunk_size, "Mamba2")
        check_impl(impl, "Mamba2")
        G, N = num_groups, state_size
        self.d_model, self.d_inner, self.num_heads, self.head_dim = d_model, Di, H, head_dim
        self.num_groups, self.state_size = G, N
        self.mode, self.chunk_size, self.impl, self.dtype = mode, chunk_size, impl, dtype

        def linear(i, o, names):
            return Linear(i, o, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                              kernel_metadata=axes(*names))

        # in_proj's output and the conv fuse [z, x, B, C, dt] / [x, B, C]: a split over `tensor` would cut
        # between the quantities, so they stay whole there (the small per-head vectors are replicated).
        self.in_proj = linear(d_model, 2 * Di + 2 * G * N + H, ("embed", None))
        conv_dim = Di + 2 * G * N
        self.conv = ShortConvolution(conv_dim, conv_size, use_bias=True, channel_axis=None,
                                     rngs=rngs) if conv_size else None
        self.dt_bias = nnx.Param(inverse_softplus_dt(rngs.params(), (H,), dt_min, dt_max, dt_init_floor))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, lo, hi)))
        self.D = nnx.Param(jnp.ones((H,), jnp.float32))
        whole = output_norm == "gated" and norm_before_gate  # the zoo's own form: statistics over all Di channels
        self.norm = None if output_norm == "none" else \
            GatedRMSNorm(Di, eps=norm_eps, norm_before_gate=norm_before_gate, groups=1 if whole else G)
        self.out_proj = linear(Di, d_model, ROWS)

    step_mode = "step"  # decode: `step` for one token and steps=True

    def init_state(self, batch_size: int, max_len: int = 0) -> Mamba2State:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        ssm = jnp.zeros((batch_size, self.num_heads, self.head_dim, self.state_size), jnp.float32)
        return Mamba2State(ssm, self.conv.init_state(batch_size, self.dtype) if self.conv is not None else None)

    def _inputs(self, x, conv_window, segment_ids, steps: bool):
        """The SSM's inputs from x (B, T, D), continuing the conv window: (z (B, T, Di), xs (B, T, H, P),
        dt (B, T, H) float32, A (H,), B, C (B, T, G, N), the new window)."""
        Bsz, T, _ = x.shape
        Di, H, P, G, N = self.d_inner, self.num_heads, self.head_dim, self.num_groups, self.state_size
        z, xBC, dt = jnp.split(self.in_proj(x), [Di, 2 * Di + 2 * G * N], axis=-1)  # (B, T, Di), (B, T, E), (B, T, H)
        if self.conv is not None:
            xBC, conv = self.conv.decode(xBC, conv_window, segment_ids=segment_ids, steps=steps)
        else:
            xBC, conv = jax.nn.silu(xBC), None
        xs, B, C = jnp.split(xBC, [Di, Di + G * N], axis=-1)
        xs = xs.reshape(Bsz, T, H, P)  # (B, T, H, P)
        B, C = B.reshape(Bsz, T, G, N), C.reshape(Bsz, T, G, N)  # (B, T, G, N)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])  # (B, T, H)
        A = -jnp.exp(self.A_log[...])  # (H,)
        return z, xs, dt, A, B, C, conv

    def _mix(self, x, state: Mamba2State, segment_ids, mode, steps: bool):
        """`mode` "step": `step` on the one token, or token by token with steps=True; else an SSD form."""
        Bsz, T, _ = x.shape
        x = x.astype(self.dtype)
        z, xs, dt, A, B, C, conv = self._inputs(x, state.conv, segment_ids, steps)
        if mode == "step":
            def step(h, xs, dt, B, C):  # on 1-token slices (B, 1, ...)
                h, y = self.step(h, xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
                return y[:, None].astype(xs.dtype), h  # (B, 1, H, P)

            args = (state.ssm, xs, dt, B, C)
            y, ssm = stepwise(step, *args) if steps else step(*args)
        else:
            y, ssm = ssd(xs, dt, A, B, C, self.D[...], segment_ids=segment_ids, initial_state=state.ssm,
                         output_final_state=True, mode=mode, chunk_size=self.chunk_size, impl=self.impl)
        y = y.reshape(Bsz, T, self.d_inner)
        y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(y.dtype) if self.norm is None else self.norm(y, z)
        return self.out_proj(y), (Mamba2State.stepped if steps else Mamba2State)(ssm, conv)

    def step(self, h: Float[Array, "B H P N"], x: Float[Array, "B H P"], dt: Float[Array, "B H"],
             A: Float[Array, " H"], B: Float[Array, "B G N"], C: Float[Array, "B G N"]):
        """One token of SSD, the core of the official `Mamba2.step` (`decode` with T = 1 is the whole
        step: conv window, projections, norm). Returns (h_t, y_t) float32."""
        return ssd_step(h, x, dt, A, B, C, self.D[...])
