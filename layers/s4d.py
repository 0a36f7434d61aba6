"""S4D mixer: Gu, Gupta, Goel & Ré 2022, "On the Parameterization and Initialization of Diagonal State
Space Models", the layer of the official `models/s4/s4d.py` (state-spaces/s4):

    y = SSM(x)                 one diagonal LTI SSM per channel (kernels/s4d), with the skip D x
    y = GELU(y)
    out = GLU(W_out y + b)     channel mixing: W_out (D, 2D), a ⊙ σ(g) (output="glu"), or W_out y + b (D, D)

SSM (per channel d, N/2 complex modes, conjugate pairs, so a real state of size N = state_size):
A_n = -exp(log_A_real_n) + i A_imag_n, Δ = exp(log_dt), ZOH Ā = exp(Δ A), B̄ = (Ā - 1) / A (B = 1),
h_t = Ā h_{t-1} + B̄ x_t, y_t = 2 Re(C h_t) + D x_t. Training runs the kernel K = (2 Re C B̄ Ā^k)_k by FFT
(mode "fft", O(T log T)) or the recurrence (mode "recurrent"); decode is the recurrence, its state
(B, D, N) float32 real pairs: [Re h, Im h] of the N/2 modes.

Initialisation (the paper's Section 4, the official code): init="lin" is S4D-Lin, A_n = -1/2 + i π n;
init="inv" S4D-Inv, A_n = -1/2 + i (N/π)(N/(2n+1) - 1); log Δ uniform in [log dt_min, log dt_max]; C
complex standard normal (real and imaginary parts of variance 1/2, torch.randn(cfloat)); D standard
normal. Code name -> paper symbol: `log_dt` log Δ, `log_A_real` log(-Re A), `A_imag` Im A, `C` C as
(D, N/2, 2) real pairs, `D` D, `out_proj` the official `output_linear` (a 1x1 Conv1d to 2D then GLU).

Departures, all named: the official code trains log_dt and A with their own learning rate and no
weight decay (`register(..., lr)`), here they are ordinary parameters; no dropout; out_proj is Flax's
lecun-normal with a zero bias instead of PyTorch's Conv1d U(±1/sqrt(D)) init. Packed documents
(`segment_ids`): the convolution cannot restart mid-sequence, so the op runs the recurrence there
(exact; kernels/s4d). There is no Pallas kernel (impl "pallas" is refused).
"""

import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_no_pallas
from kernels.s4d import MODES, discretize, s4d, s4d_step
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.options import Impl, OneOf, PosFloat, PosInt
from layers.sharding import axes
from layers.state import state, stepwise


@state
class S4DState:
    ssm: Float[Array, "B D N"]  # (B, D, N) float32: [Re h, Im h] of the N/2 complex modes per channel


class S4D(SequenceMixer):
    """S4D (Gu, Gupta, Goel & Ré 2022): a diagonal linear time-invariant SSM per channel, state_size N (N/2 complex
    conjugate pairs), init lin (S4D-Lin, A_n = -1/2 + i π n) or inv (S4D-Inv), log Δ uniform in [dt_min, dt_max], GELU,
    then output glu (linear to 2 d_model and a GLU) or linear; mode fft (the SSM's kernel applied by FFT, O(T log T)) or
    recurrent; decode is the recurrence; impl: "auto", "reference" or "xla" (no Pallas kernel); dtype: the compute dtype
    (parameters stay float32)."""

    context_parallel = True  # the FFT over the sequence is inside kernels.s4d, whose form splits it

    def __init__(self, d_model: int, *, state_size: PosInt = 64, init: Annotated[str, OneOf("lin", "inv")] = "lin",
                 dt_min: PosFloat = 0.001, dt_max: PosFloat = 0.1,
                 output: Annotated[str, OneOf("glu", "linear")] = "glu",
                 mode: Annotated[str, OneOf("recurrent", "fft")] = "fft", impl: Impl = "auto", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if d_model < 1 or state_size < 2 or state_size % 2:
            raise ValueError(f"S4D: d_model={d_model} must be >= 1 and state_size={state_size} even and >= 2 "
                             "(conjugate pairs)")
        if init not in ("lin", "inv") or output not in ("glu", "linear") or mode not in MODES:
            raise ValueError(f"S4D: init={init!r}, output={output!r}, mode={mode!r}; expected init 'lin' or 'inv', "
                             f"output 'glu' or 'linear', mode one of {MODES}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"S4D: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        check_no_pallas(impl, "S4D")
        D, N, M = d_model, state_size, state_size // 2
        self.d_model, self.state_size, self.output = D, N, output
        self.mode, self.impl, self.dtype = mode, impl, dtype
        n = jnp.arange(M, dtype=jnp.float32)
        A_imag = math.pi * n if init == "lin" else N / math.pi * (N / (2 * n + 1) - 1)
        self.log_dt = nnx.Param(jax.random.uniform(rngs.params(), (D,), jnp.float32, math.log(dt_min),
                                                   math.log(dt_max)), **axes("heads"))
        self.log_A_real = nnx.Param(jnp.full((D, M), math.log(0.5), jnp.float32), **axes("heads", None))
        self.A_imag = nnx.Param(jnp.broadcast_to(A_imag, (D, M)), **axes("heads", None))
        self.C = nnx.Param(jax.random.normal(rngs.params(), (D, M, 2), jnp.float32) * 0.5 ** 0.5,
                           **axes("heads", None, None))
        self.D = nnx.Param(jax.random.normal(rngs.params(), (D,), jnp.float32), **axes("heads"))
        width = 2 * D if output == "glu" else D
        self.out_proj = Linear(D, width, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                               kernel_metadata=axes("heads", "embed"), bias_metadata=axes("embed"))

    step_mode = "step"  # decode: the recurrence for one token and steps=True, the layer's mode for T > 1

    @property
    def prefill_mode(self) -> str:
        return self.mode

    def init_state(self, batch_size: int, max_len: int = 0) -> S4DState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        return S4DState(jnp.zeros((batch_size, self.d_model, self.state_size), jnp.float32))

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        """The training path: the op from no state (returning none), not from a zero one."""
        self._check(x, segment_ids)
        return self._mix(x, None, segment_ids, self.mode, False)[0]

    def ssm_params(self):
        """(A, Δ, C) of the SSM: A and C (D, N/2) complex64, Δ (D,) float32."""
        A = jax.lax.complex(-jnp.exp(self.log_A_real[...]), self.A_imag[...])
        return A, jnp.exp(self.log_dt[...]), jax.lax.complex(self.C[..., 0], self.C[..., 1])

    def _mix(self, x, state: S4DState | None, segment_ids, mode, steps: bool):
        x = x.astype(self.dtype)
        A, dt, C = self.ssm_params()
        M = self.state_size // 2
        h0 = None if state is None else jax.lax.complex(state.ssm[..., :M], state.ssm[..., M:])  # (B, D, N/2)
        if mode == "step":
            Abar, Bbar = discretize(A, dt)

            def step(h, u):  # on 1-token slices (B, 1, D)
                h, y = s4d_step(h, u[:, 0], Abar, Bbar, C, self.D[...])
                return y[:, None].astype(u.dtype), h

            y, h = stepwise(step, h0, x) if steps else step(h0, x)
        else:
            y, h = s4d(x, A, dt, C, self.D[...], segment_ids=segment_ids, initial_state=h0,
                       output_final_state=state is not None, mode=mode, impl=self.impl)
        y = jax.nn.gelu(y, approximate=False)
        y = self.out_proj(y)
        if self.output == "glu":
            a, g = jnp.split(y, 2, axis=-1)  # (B, T, D) each
            y = a * jax.nn.sigmoid(g)
        if state is None:
            return y, None
        ssm = jnp.concatenate([jnp.real(h), jnp.imag(h)], axis=-1)  # (..., B, D, N) real pairs
        return y, (S4DState.stepped if steps else S4DState)(ssm)
