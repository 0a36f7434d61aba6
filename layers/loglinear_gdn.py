"""Log-linear Gated DeltaNet: Guo, Yang, Goel, Xing, Dao & Kim, 2025, "Log-Linear Attention" (arXiv:2506.04761),
Section 4 ("Log-Linear Gated DeltaNet"), following the official `HGatedDeltaNet` (HanGuo97/log-linear-attention):
the Gated DeltaNet layer (layers/deltanet.py) whose one delta-rule state per head becomes a Fenwick tree of
O(log T) states, each key weighted by a data-dependent λ of its level, with the λ projection of log-linear
Mamba-2 (layers/loglinear.py):

    q, k, v, β, α and the output gate as Gated DeltaNet's (short convolutions, SiLU, L2-normalised q and k)
    λ_t^(ℓ) = softplus(Λ_{h,ℓ} · (W_λ x_t)_{h,ℓ})                                         (H, L) per token
    o_t = Σ_{s ≤ t} λ_t^(ℓ(t, s)) (q_t^T Φ(t, s) k_s) β_s v_s / sqrt(K)              (kernels/loglinear_gdn)
    Φ(t, s) = Π_{s < r ≤ t} α_r (I - β_r k_r k_r^T),    ℓ(t, s) = bit_length(t XOR s) inside the document
    y_t = W_o [RMSNorm(o_t) * SiLU(W_g x_t)]

With λ ≡ 1 the layer is Gated DeltaNet (the levels sum to its state).

Code name -> paper symbol: Gated DeltaNet's names (layers/deltanet.py); `level_proj` W_λ (the official
`l_proj`), `level_scale` Λ (H, max_levels) (the official `L`, ones at init). The decode state's `fenwick` holds
S^(0) .. S^(L-1) (B, H, L, K, V), `count` the tokens of the current document so far (B,), `conv_q`, `conv_k`,
`conv_v` the short convolutions' windows. L = ceil(log2 max_len) + 1, at most max_levels: the state grows with
the log of init_state's max_len (`grows_with_context`), as layers/loglinear.py's.

Departures, all named (and Gated DeltaNet's own, layers/deltanet.py):
- The output keeps the delta rule's 1/sqrt(K); the official code divides λ by that scale (SCALE_LAMBDA), so its
  output is unscaled: the same function family up to Λ, W_λ, and λ ≡ 1 gives this zoo's Gated DeltaNet exactly.
- max_levels (default 15) sizes λ; a document longer than 2^(L-1) tokens puts every key of level L or more at
  level L - 1, and decoding is sized like a KV cache (`decode` refuses more than 2^(L-1) tokens per document,
  `overflowed()` flags a row that went past them under jit), as layers/loglinear.py.
- The official cached decoding keeps per-level counts (its "weak" cascade); this state keeps the position and
  merges by its trailing zeros, kernels/loglinear's convention.
- No chunked form yet: mode is "parallel" (quadratic, the default) or "recurrent" (token by token); decode runs
  the recurrence for one token and steps=True, the parallel form for a prefill of T > 1 tokens. No Pallas kernel.
"""

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kernels.loglinear_gdn import loglinear_gated_delta_rule
from layers.conv import init_windows
from layers.deltanet import GatedDeltaNet, normalize_qk
from layers.loglinear import FenwickLevels, LogLinearImpl, LogLinearMode
from layers.options import NonNegInt, PosFloat, PosInt
from layers.state import state


@state
class LogLinearGatedDeltaNetState:
    fenwick: Float[Array, "B H L K V"]  # (B, H, L, K, V) float32 Fenwick states S^(0) .. S^(L-1)
    count: Int[Array, " B"]  # (B,) int32 tokens of the current document so far (the next token's position)
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K)
    conv_v: Float[Array, "B W H*V"] | None  # (B, conv_size - 1, H*V)

    def overflowed(self) -> Bool[Array, ""]:
        """True once a row's document ran past the 2^(L-1) tokens whose levels L states keep apart (as
        layers/loglinear.LogLinearMamba2State.overflowed)."""
        return jnp.any(self.count > 2 ** (self.fenwick.shape[-3] - 1))


class LogLinearGatedDeltaNet(FenwickLevels, GatedDeltaNet):
    """Log-linear Gated DeltaNet (Guo et al. 2025): Gated DeltaNet (num_heads, head_dim, expand_v, conv_size,
    use_output_gate, norm_eps as gated_deltanet's) whose state is a Fenwick tree of O(log T) delta-rule states, each
    key weighted by a data-dependent λ of its level; max_levels: the levels λ has (contexts up to 2^(max_levels - 1)
    tokens keep every level apart); mode ("parallel" | "recurrent") the training path's exact form; impl ("auto" |
    "reference" | "xla"); dtype: the compute dtype (parameters stay float32)."""

    State = LogLinearGatedDeltaNetState

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None,
                 expand_v: PosFloat = 2.0, conv_size: NonNegInt = 4, use_output_gate: bool = True,
                 max_levels: PosInt = 15, norm_eps: PosFloat = 1e-5, mode: LogLinearMode = "parallel",
                 impl: LogLinearImpl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        self._check_levels("LogLinearGatedDeltaNet", max_levels, mode, impl)
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, norm_eps=norm_eps, mode=mode, impl=impl, dtype=dtype,
                         rngs=rngs)
        self._init_levels(d_model, max_levels, dtype, rngs)

    def init_state(self, batch_size: int, max_len: int = 0) -> LogLinearGatedDeltaNetState:
        """A zero state of `_levels(max_len)` levels."""
        S = jnp.zeros((batch_size, self.num_heads, self._levels(max_len), self.head_dim, self.value_dim), jnp.float32)
        return self.State(S, jnp.zeros((batch_size,), jnp.int32), *init_windows(self._convs(), batch_size, self.dtype))

    def _carry(self, state: LogLinearGatedDeltaNetState) -> tuple:
        return state.fenwick, state.count

    def _recurrence(self, q, k, v, x, segment_ids, mode):
        """DeltaRuleMixer's hook: the log-linear op on a (Fenwick states, count) carry, with λ (B, T, H, max_levels)
        among its inputs, cut to the state's L levels."""
        B, T = x.shape[:2]
        q, k, v = normalize_qk(q, "l2"), normalize_qk(k[:, :, 0], "l2"), v[:, :, 0]  # (B, T, H, K), v (B, T, H, V)
        beta, g = self._gates(x)  # (B, T, H) float32 each
        lam = self._lambda(x, self.max_levels)  # (B, T, H, max_levels)

        def op(carry, q, k, v, beta, g, lam):
            o, carry = loglinear_gated_delta_rule(
                q, k, v, beta, g, lam[..., :carry[0].shape[2]], segment_ids=segment_ids, initial_state=carry[0],
                initial_count=carry[1], output_final_state=True, mode=mode, impl=self.impl)
            return o, carry

        return op, (q, k, v, beta, g, lam)
