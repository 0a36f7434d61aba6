"""The delta rule's 2025 variants: Gated DeltaNet-2 (erase decoupled from write) and Comba (output
correction), each as flash-linear-attention's layer computes it (`fla/layers/gdn2.py`, `fla/layers/comba.py`).

Gated DeltaNet-2 (NVIDIA 2026, "Gated DeltaNet-2: Decoupling Erase and Write in Linear Attention",
arXiv 2605.22791; fla's `GatedDeltaNet2`): Kimi Delta Attention (layers/deltanet.py) with its scalar beta split
into an erase gate b_t per key channel and a write gate w_t per value channel:

    S_t = (I - k_t (b_t ⊙ k_t)^T) diag(alpha_t) S_{t-1} + k_t (w_t ⊙ v_t)^T,    o_t = S_t^T q_t / sqrt(K)
    b_t = sigmoid(W_b x_t) (x 2 with allow_neg_eigval),  w_t = sigmoid(W_w x_t)

with KDA's q, k, v (short convolutions, SiLU, L2-normalised q and k), its per-channel decay alpha_t and
its sigmoid-gated output norm; b = w = beta gives KDA back. The erase is no longer symmetric, so the
transition diag(alpha) - k (b ⊙ k ⊙ alpha)^T is a general diagonal-plus-rank-one (DPLR) matrix: the op
(kernels/gdn2) runs on RWKV-7's (kernels/wkv7) in every fast mode and implementation, Pallas included.

Comba (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop Control", arXiv 2506.02475; fla's
`Comba`): Gated DeltaNet (Mamba-2's scalar decay alpha_t per head) with the erase read through a second
key p_t and an output correction of the query:

    p_t = sigmoid(d) ⊙ k_t,   q_t <- q_t - D p_t                  d, D per head (inner decay, correction)
    S_t = alpha_t (I - beta_t k_t p^_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q^_t / sqrt(K)
    y_t = W_o [RMSNorm(o_t) ⊙ sigmoid(W_g x_t)]

where ^ is the L2 normalisation fla's kernels apply to q, k and p (`use_qk_l2norm_in_kernel`). Normalising
p = sigmoid(d) k gives p^ = k^, so in fla's computation (and here) the transition is Gated DeltaNet's and
the inner decay d acts only through the correction D sigmoid(d) k_t, taken before q is normalised. Comba
therefore runs on the delta-rule op (kernels/delta_rule) with the corrected query, in every mode and
implementation.

Code names: `num_heads` H, `head_dim` K, `expand_v` V / K; GDN-2: `b_proj` W_b (erase, H*K), `w_proj` W_w
(write, H*V), the decay and output gate KDA's (`f_down`, `f_up`, `A_log`, `dt_bias`, `g_down`, `g_up`);
Comba: `decay` d, `D` D (initialised to correction_factor), `a_proj`, `A_log`, `dt_bias` Gated DeltaNet's decay,
`b_proj` beta, `g_proj` W_g.

Departures, named: GDN-2 has no `safe_gate` / `gate_lower_bound` (fla's bounded in-kernel gate for its
tensor-core path), no grouped value heads (`num_v_heads`); Comba has no grouped value heads, and its
output gate is always on (fla's use_output_gate=False norm without gate is not offered). Initialisation:
the zoo's Linear default; A_log, dt_bias, d = 1 and D = correction_factor as fla.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.gdn2 import gdn2
from layers.deltanet import GatedDeltaNet, KimiDeltaAttention, normalize_qk
from layers.linear import Linear
from layers.norm import RMSNorm
from layers.options import Impl, Mode, NonNegFloat, NonNegInt, PosFloat, PosInt
from layers.sharding import COLUMNS, axes


class GatedDeltaNet2(KimiDeltaAttention):
    """Gated DeltaNet-2 (NVIDIA 2026): Kimi Delta Attention with the scalar beta split into an erase gate per key
    channel and a write gate per value channel, on RWKV-7's DPLR op; allow_neg_eigval: the erase gate in (0, 2);
    head_dim, expand_v, conv_size, norm_eps as DeltaNet's; mode ("recurrent" | "chunk" | "parallel") picks the
    training path's exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's
    implementation on every path; dtype: the compute dtype (parameters stay float32)."""

    context_parallel = False  # its value-side gate acts on the state's other axis: no form yet (kernels/context.py)

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 1.0,
                 conv_size: NonNegInt = 4, allow_neg_eigval: bool = False, norm_eps: PosFloat = 1e-5,
                 mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps, mode=mode, chunk_size=chunk_size,
                         impl=impl, dtype=dtype, rngs=rngs)
        H, K, V = self.num_heads, self.head_dim, self.value_dim
        linear = lambda o: Linear(d_model, o, use_bias=False, dtype=dtype, rngs=rngs, kernel_metadata=axes(*COLUMNS))
        self.b_proj, self.w_proj = linear(H * K), linear(H * V)  # erase gate (per key channel), write gate

    def _recurrence(self, q, k, v, x, segment_ids, mode):
        q, k, v = normalize_qk(q, "l2"), normalize_qk(k[:, :, 0], "l2"), v[:, :, 0]  # (B, T, H, K), v (B, T, H, V)
        gate = lambda proj: jax.nn.sigmoid(proj(x).astype(jnp.float32)).reshape(*k.shape[:3], -1)
        erase, write = gate(self.b_proj), gate(self.w_proj)  # (B, T, H, K), (B, T, H, V)
        erase = 2.0 * erase if self.allow_neg_eigval else erase
        op = lambda S, q, k, v, g, b, w: gdn2(q, k, v, g, b, w, segment_ids=segment_ids, initial_state=S,
                                              output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                              impl=self.impl)
        return op, (q, k, v, self._log_decay(x), erase, write)


class Comba(GatedDeltaNet):
    """Comba (Hu et al. 2025): Gated DeltaNet with the query corrected by -D sigmoid(d) k (use_output_correction; D
    starts at correction_factor, d the inner decay, use_inner_decay) and a sigmoid output gate, as fla's Comba (module
    docstring: with fla's L2 norms the erase key equals k); head_dim, expand_v, conv_size, norm_eps as DeltaNet's; mode
    ("recurrent" | "chunk" | "parallel") picks the training path's exact form, chunk_size its chunk; impl ("auto" |
    "reference" | "xla" | "pallas") picks the op's implementation on every path; dtype: the compute dtype (parameters
    stay float32)."""

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 2.0,
                 conv_size: NonNegInt = 4, use_output_correction: bool = True, correction_factor: NonNegFloat = 1.0,
                 use_inner_decay: bool = True, norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64,
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=True, norm_eps=norm_eps, mode=mode, chunk_size=chunk_size, impl=impl,
                         dtype=dtype, rngs=rngs)
        H = self.num_heads
        self.o_norm = RMSNorm(self.value_dim, eps=norm_eps)  # gated by a sigmoid in _output, not GatedRMSNorm's SiLU
        self.decay = nnx.Param(jnp.ones((H,), jnp.float32), **axes("heads")) if use_inner_decay else None
        self.D = (nnx.Param(jnp.full((H,), correction_factor, jnp.float32), **axes("heads"))
                  if use_output_correction else None)

    def _recurrence(self, q, k, v, x, segment_ids, mode):
        if self.D is not None:  # q - D p with p = sigmoid(d) k, before the norms
            p = k[:, :, 0] if self.decay is None else k[:, :, 0] * jax.nn.sigmoid(self.decay[...])[:, None]
            q = (q - self.D[...][:, None] * p).astype(q.dtype)  # (B, T, H, K)
        return super()._recurrence(q, k, v, x, segment_ids, mode)

    def _output(self, o, x):
        gate = jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).reshape(o.shape)
        return (self.o_norm(o).astype(jnp.float32) * gate).astype(o.dtype)  # RMSNorm(o) * sigmoid(W_g x)
