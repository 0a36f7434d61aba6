"""Log-linear Mamba-2: Guo, Yang, Goel, Xing, Dao & Kim, 2025, "Log-Linear Attention" (arXiv:2506.04761),
Section 4 ("Log-Linear Mamba-2"), following fla's `fla.layers.log_linear_mamba2.LogLinearMamba2`: the
Mamba-2 block (layers/mamba2.py) with its SSD replaced by log-linear attention over a Fenwick tree of
states, and one more projection for the per-level weights λ:

    z, xBC, dt = W_in x,  x, B, C = SiLU(conv1d(xBC)),  Δ = softplus(dt + dt_bias)     as Mamba-2
    λ_t^(ℓ) = softplus(Λ_{h,ℓ} · (W_λ x_t)_{h,ℓ})                                        (H, L) per token
    y_t = Σ_{s ≤ t} λ_t^(ℓ(t, s)) exp(Σ_{s < r ≤ t} Δ_r A) (C_t · B_s) Δ_s x_s + D x_t   (kernels/loglinear)
    out = W_out GatedRMSNorm(y, z)

with ℓ(t, s) = bit_length(t XOR s) the Fenwick level of key s for query t (positions inside the document).

Code name -> paper symbol: everything Mamba-2 has keeps its name (layers/mamba2.py); `level_proj` W_λ (the
fla layer's `dl` slice of in_proj), `level_scale` Λ (H, max_levels) (fla's `L`, ones at init). The decode
state's `fenwick` holds the states S^(0) .. S^(L-1) (B, H, L, P, N), `count` the tokens of the current
document seen so far (B,), `conv` Mamba-2's conv window. L = ceil(log2 max_len) + 1 levels, capped at
max_levels: the state grows with the log of init_state's max_len (`grows_with_context`).

Departures, all named (and Mamba-2's own, layers/mamba2.py):
- W_λ is a Linear of its own rather than a slice of in_proj, and has no bias (fla's in_proj has one when
  use_bias): the same function family, Mamba2's parameters untouched.
- max_levels (default 15, fla's 16384-token maximum) sizes λ; a document longer than 2^(L-1) tokens puts
  every key of level L or more at level L - 1 (the top state absorbs the oldest buckets, kernels/loglinear).
- fla initialises A = -[1 .. H] and norms after gating by default; this layer keeps Mamba2's A ~ U(A_init_range)
  and its norm_before_gate option. fla's cached decoding keeps the last chunk's inputs; this state is the
  Fenwick states themselves, O(log max_len) per head.
- Decoding is sized like a KV cache: `decode` refuses more than 2^(L-1) tokens per document (the tokens
  whose levels L states keep apart; under jit only a call longer than that) and the state's `overflowed()`
  flags a row that went past them under jit, after which its oldest keys share the top level's λ.
- head_dim defaults to 32 (Mamba2's is 64), so that the defaults build at d_model 16.
- No chunked form yet: mode is "parallel" (quadratic, the default) or "recurrent" (token by token); decode
  runs the recurrence for one token and steps=True, the parallel form for a prefill of T > 1 tokens.
"""

from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kernels import check_mode
from kernels.loglinear import MODES, loglinear_ssd, loglinear_step, num_levels
from layers.linear import Linear
from layers.mamba2 import Mamba2
from layers.options import NonNegInt, OneOf, PosFloat, PosInt
from layers.sharding import axes
from layers.state import state, stepwise

LogLinearMode = Annotated[str, OneOf(*MODES)]
LogLinearImpl = Annotated[str, OneOf("auto", "reference", "xla")]


@state
class LogLinearMamba2State:
    fenwick: Float[Array, "B H L P N"]  # (B, H, L, P, N) float32 Fenwick states S^(0) .. S^(L-1)
    count: Int[Array, " B"]  # (B,) int32 tokens of the current document so far (the next token's position)
    conv: Float[Array, "B W _Dconv"] | None  # (B, conv_size - 1, Di + 2 G N) last conv inputs; None if conv_size = 0

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row's document ran past the 2^(L-1) tokens whose levels L states keep apart (later keys
        then share the top level's λ): eager decode raises instead, but under jit nothing can, so callers check
        this (as layers/attention.KVCache.overflowed)."""
        return jnp.any(self.count > 2 ** (self.fenwick.shape[-3] - 1))


class FenwickLevels:
    """What the log-linear kinds share over their base layer: the level weights λ (their projection W_λ
    `level_proj` and scale Λ `level_scale`), the levels a state gets for a context, and decoding refused past
    them. Mixed in before the base layer's class; `_init_levels` runs after its __init__."""

    context_parallel = False  # the Fenwick levels' states: no form yet (kernels/context.py)

    grows_with_context = True  # L = ceil(log2 max_len) + 1 Fenwick states per head
    step_mode, prefill_mode = "recurrent", "parallel"

    @staticmethod
    def _check_levels(where: str, max_levels, mode: str, impl: str):
        if not isinstance(max_levels, int) or not 1 <= max_levels <= 31:
            raise ValueError(f"{where}: max_levels={max_levels!r}; expected an int in [1, 31] (positions are int32)")
        check_mode(mode, 1, where, MODES)
        if impl not in ("auto", "reference", "xla"):
            raise ValueError(f"{where}: impl={impl!r}; expected one of 'auto', 'reference', 'xla' (no Pallas kernel)")

    def _init_levels(self, d_model: int, max_levels: int, dtype, rngs: nnx.Rngs):
        H = self.num_heads
        self.max_levels = max_levels
        self.level_proj = Linear(d_model, H * max_levels, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                                 rngs=rngs, kernel_metadata=axes("embed", None))
        self.level_scale = nnx.Param(jnp.ones((H, max_levels), jnp.float32), **axes("heads", None))

    def _levels(self, max_len: int) -> int:
        """L = ceil(log2 max_len) + 1 levels for a context of max_len (max_levels when 0 or more are needed)."""
        return self.max_levels if max_len <= 0 else min(num_levels(max_len), self.max_levels)

    def _lambda(self, x: Float[Array, "B T D"], L: int) -> Float[Array, "B T H L"]:
        """λ_t^(ℓ) = softplus(Λ_{h,ℓ} · (W_λ x_t)_{h,ℓ}) for the first L levels, float32."""
        B, T, _ = x.shape
        dl = self.level_proj(x).reshape(B, T, self.num_heads, self.max_levels)[..., :L]  # (B, T, H, L)
        return jax.nn.softplus(self.level_scale[...][:, :L] * dl.astype(jnp.float32))

    def decode(self, x: Float[Array, "B T D"], state, *, segment_ids: Int[Array, "B T"] | None = None,
               steps: bool = False):
        """SequenceMixer.decode, refusing more tokens than the state's levels keep apart (2^(L-1) per document,
        counted as a KV cache counts its slots: under jit only a call longer than that; `overflowed` flags the rest)."""
        self._check(x, segment_ids, steps)
        self._check_room(state.count, x.shape[1], 2 ** (state.fenwick.shape[-3] - 1))
        return super().decode(x, state, segment_ids=segment_ids, steps=steps)


class LogLinearMamba2(FenwickLevels, Mamba2):
    """Log-linear Mamba-2 (Guo et al. 2025): Mamba-2 (state_size, expand, head_dim, num_groups, conv_size, dt_min,
    dt_max, dt_init_floor, A_init_range, norm_before_gate, norm_eps as in mamba2) whose state is a Fenwick tree of
    O(log T) states, each key weighted by a data-dependent λ of its level; max_levels: the levels λ has (contexts
    up to 2^(max_levels - 1) tokens keep every level apart); mode ("parallel" | "recurrent") the training path's
    exact form; impl ("auto" | "reference" | "xla"); dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, state_size: PosInt = 64, expand: PosInt = 2, head_dim: PosInt = 32,
                 num_groups: PosInt = 1, conv_size: NonNegInt = 4, max_levels: PosInt = 15,
                 mode: LogLinearMode = "parallel", dt_min: PosFloat = 0.001, dt_max: PosFloat = 0.1,
                 dt_init_floor: PosFloat = 1e-4, A_init_range: tuple[PosFloat, PosFloat] = (1.0, 16.0),
                 norm_before_gate: bool = True, norm_eps: PosFloat = 1e-5, impl: LogLinearImpl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self._check_levels("LogLinearMamba2", max_levels, mode, impl)
        super().__init__(d_model, state_size=state_size, expand=expand, head_dim=head_dim, num_groups=num_groups,
                         conv_size=conv_size, mode=mode, dt_min=dt_min, dt_max=dt_max, dt_init_floor=dt_init_floor,
                         A_init_range=A_init_range, norm_before_gate=norm_before_gate, norm_eps=norm_eps, impl=impl,
                         dtype=dtype, rngs=rngs)
        self._init_levels(d_model, max_levels, dtype, rngs)

    def init_state(self, batch_size: int, max_len: int = 0) -> LogLinearMamba2State:
        """A zero state of `_levels(max_len)` levels."""
        S = jnp.zeros((batch_size, self.num_heads, self._levels(max_len), self.head_dim, self.state_size),
                      jnp.float32)
        conv = self.conv.init_state(batch_size, self.dtype) if self.conv is not None else None
        return LogLinearMamba2State(S, jnp.zeros((batch_size,), jnp.int32), conv)

    def _mix(self, x, state: LogLinearMamba2State, segment_ids, mode, steps: bool):
        Bsz, T, _ = x.shape
        x = x.astype(self.dtype)
        lam = self._lambda(x, state.fenwick.shape[-3])  # (B, T, H, L)
        z, xs, dt, A, B, C, conv = self._inputs(x, state.conv, segment_ids, steps)  # Mamba-2's

        def op(carry, xs, dt, B, C, lam, segment_ids=None, mode=mode):
            y, carry = loglinear_ssd(xs, dt, A, B, C, lam, self.D[...], segment_ids=segment_ids,
                                     initial_state=carry[0], initial_count=carry[1], output_final_state=True,
                                     mode=mode, impl=self.impl)
            return y, carry

        carry = (state.fenwick, state.count)
        if steps:  # the state after every token, for rollback
            y, (S, n) = stepwise(lambda c, *a: op(c, *a, mode="recurrent"), carry, xs, dt, B, C, lam)
        else:
            y, (S, n) = op(carry, xs, dt, B, C, lam, segment_ids)
        y = self.norm(y.reshape(Bsz, T, self.d_inner), z)
        return self.out_proj(y), (LogLinearMamba2State.stepped if steps else LogLinearMamba2State)(S, n, conv)

    def step(self, S: Float[Array, "B H L P N"], n: Int[Array, " B"], x: Float[Array, "B H P"],
             dt: Float[Array, "B H"], A: Float[Array, " H"], B: Float[Array, "B G N"], C: Float[Array, "B G N"],
             lam: Float[Array, "B H L"]):
        """One token of the op (in place of Mamba2.step): returns (S_t, n + 1, y_t) float32."""
        return loglinear_step(S, n, x, dt, A, B, C, lam, self.D[...])
