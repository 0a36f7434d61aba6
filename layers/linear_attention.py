"""Linear attention with a choice of feature maps (Katharopoulos et al., 2020, "Transformers are RNNs").

    q_t, k_t, v_t = x_t W_Q, x_t W_K, x_t W_V          per head, head dim K = d_model / num_heads
    S_t = S_{t-1} + phi(k_t)^T v_t                    z_t = z_{t-1} + phi(k_t)^T
    o_t = phi(q_t) S_t / (phi(q_t) z_t + eps)         (normalize=True; else o_t = phi(q_t) S_t)
    y_t = concat_h(o_t) W_O

z is computed by the same op as S, by appending a ones column to v, so it follows the same document
resets. Feature maps phi (F is the feature dim the op sees):
- "identity": phi(x) = x (F = K). Its phi(q) z can be zero or negative, so it requires normalize=False.
- "elu": elu(x) + 1 (Katharopoulos et al., 2020), F = K.
- "relu": max(x, 0), F = K.
- "performer": FAVOR+ positive orthogonal random features (Choromanski et al., 2021, "Rethinking
  Attention with Performers", positive random features): phi(x) = exp(w_i^T x' - |x'|^2 / 2) / sqrt(m), i = 1..m,
  x' = x K^-1/4 so that phi(q) phi(k)^T estimates exp(q k^T / sqrt(K)); F = m = num_features. The
  rows w_i are Gaussian blocks made orthogonal by QR and rescaled to chi-distributed norms, one
  projection shared by all heads (as in the paper). They are a non-trainable `RandomFeatures`
  variable, so decoding always uses the features the state was built with; `redraw_features(key)`
  draws new ones (call it between training steps only, never between prefill and decode: a state
  built with other features is meaningless). Departure from the official code: the official
  stabiliser subtracts a max over all keys of the sequence, which would leak the future in a causal
  model; here only queries are stabilised (a per-token max, which cancels exactly in the normaliser,
  so it is applied only when normalize=True) and keys are not (their exponent is bounded by |w|^2/2).
- "cosformer": cosFormer (Qin et al., 2022) relu features with the re-weighting
  cos(pi/2 (i - j) / M) = cos(a i) cos(a j) + sin(a i) sin(a j), a = pi / (2M), split into a cos half
  and a sin half so it stays causal and recurrent: phi(x_i) = [relu(x_i) cos(a i), relu(x_i) sin(a i)],
  F = 2K. i is the position inside the document (kernels.segments.positions_in_document); M is
  `cosformer_max_len` (the paper uses the sequence length; documents longer than M make the weight
  negative). The decode state keeps a (B,) position counter.
- "hedgehog": Hedgehog (Zhang et al., 2024, "The Hedgehog & the Porcupine"): a learnable per-head
  linear map, then a softmax over [z, -z] with z = x W_h + b_h; F = 2K. Separate maps for q and k,
  initialised to the identity (W = I, b = 0). Departure: the paper's code applies a softmax to each
  half separately; we follow flash-linear-attention's single softmax over both halves (without its
  factor 2 on z).
- "taylor": Based (Arora et al., 2024, "Simple linear attention language models balance the
  recall-throughput tradeoff"): the second-order Taylor expansion of exp, phi(x) = [1, x', x' ⊗ x' / sqrt(2)]
  with x' = x d^-1/4 (d = qk_dim, as the official TaylorExp: its x / d^1/4 and (x ⊗ x) / (sqrt(2) sqrt(d))),
  so phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d). Departure (exact): only the
  symmetric half of x' ⊗ x' is kept, the diagonal x'_i^2 / sqrt(2) and x'_i x'_j for i < j, which
  gives the same dot products with F = 1 + d + d (d + 1) / 2 instead of 1 + d + d^2 (153 for
  Based's d = 16, not 273). 1 + s + s^2 / 2 > 0, so the normaliser is never zero.

`qk_dim` is the per-head width of the query and key projections the feature map reads (None = the
head dim K): Based projects them to a small feature_dim (16) and keeps values at K.

The query scale is 1: with the normaliser it cancels. `impl` picks the op's implementation ("auto",
"reference", "xla" or "pallas", see kernels/linear_attention) on every path: the training call, a
multi-token decode and the single-token decode step. Every feature map and normalize setting works
with every impl (the feature map and the normaliser column are applied outside the op);
impl="reference" runs the token-by-token scan whatever the mode; impl="pallas" runs the GLA Pallas
kernels with a zero scalar gate, whose chunk is their own block size (mode and chunk_size are then
unused): the Triton kernels on a GPU, the Mosaic ones on a TPU (kernels.pallas_platform()).
"""

import math
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.linear_attention import linear_attention
from kernels.segments import positions_in_document
from layers.linear import Linear
from layers.mixer import SequenceMixer
from layers.options import Impl, Mode, OneOf, PosFloat, PosInt
from layers.sharding import COLUMNS, ROWS, axes
from layers.state import per_token, state, stepwise

FEATURE_MAPS = ("identity", "elu", "relu", "performer", "cosformer", "hedgehog", "taylor")


@state
class LinearAttentionState:
    S: Float[Array, "B H F _V1"]  # (B, H, F, V + 1) with the normaliser column, else (B, H, F, V); float32
    pos: Int[Array, " B"]  # (B,) position of the next token inside its document (used by cosformer)


class RandomFeatures(nnx.Variable):
    """Performer's random projection: state of the layer, but not a trained parameter."""


def orthogonal_random_features(key: jax.Array, num_features: int, dim: int) -> Float[Array, "F K"]:
    """Rows w_i: blocks of `dim` orthogonal directions (QR of a Gaussian matrix) with the lengths of
    independent Gaussian vectors, so each row is marginally N(0, I) (Choromanski et al., 2021,
    orthogonal random features)."""
    k_dirs, k_norms = jax.random.split(key)
    blocks = -(-num_features // dim)
    dirs, r = jnp.linalg.qr(jax.random.normal(k_dirs, (blocks, dim, dim)))  # orthonormal columns
    # QR fixes the signs of R's diagonal, which biases the directions; undoing it makes Q Haar-uniform.
    dirs = dirs * jnp.sign(jnp.diagonal(r, axis1=1, axis2=2))[:, None, :]
    dirs = jnp.swapaxes(dirs, 1, 2).reshape(blocks * dim, dim)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(k_norms, (num_features, dim)), axis=-1)
    return dirs * norms[:, None]


class LinearAttention(SequenceMixer):
    """Linear attention (Katharopoulos et al. 2020) with a feature map: identity, elu (elu+1), relu, performer (FAVOR+,
    num_features random features, None = K), cosformer (relu + cos re-weighting over cosformer_max_len), hedgehog
    (learned), taylor (Based's second-order Taylor expansion of exp); num_heads divides d_model (K = d_model /
    num_heads); normalize adds the denominator phi(q) . sum(phi(k)) + eps; qk_dim: the per-head width of q and k the
    feature map reads (None = K; Based uses 16); mode ("recurrent" | "chunk" | "parallel") picks the training path's
    exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path; dtype: the compute dtype (parameters stay float32)."""

    context_parallel = True

    def __init__(self, d_model: int, *, num_heads: PosInt = 4,
                 feature_map: Annotated[str, OneOf(*FEATURE_MAPS)] = "elu", normalize: bool = True,
                 num_features: PosInt | None = None, qk_dim: PosInt | None = None, cosformer_max_len: PosInt = 2048,
                 eps: PosFloat = 1e-6, mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if d_model % num_heads:
            raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}")
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map={feature_map!r}; expected one of {FEATURE_MAPS}")
        if normalize and feature_map == "identity":
            raise ValueError("feature_map='identity' needs normalize=False: phi(q) z can be zero or negative")
        check_mode(mode, chunk_size, "LinearAttention")
        if num_features is not None and num_features < 1:
            raise ValueError(f"num_features={num_features} must be >= 1")
        if qk_dim is not None and qk_dim < 1:
            raise ValueError(f"qk_dim={qk_dim} must be >= 1")
        if cosformer_max_len < 1:
            raise ValueError(f"cosformer_max_len={cosformer_max_len} must be >= 1")
        check_impl(impl, "LinearAttention")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.feature_map, self.normalize, self.eps = feature_map, normalize, eps
        self.cosformer_max_len, self.mode, self.chunk_size, self.dtype = cosformer_max_len, mode, chunk_size, dtype
        self.impl, self.qk_dim = impl, qk_dim or self.head_dim
        K, H = self.qk_dim, num_heads  # K: the width phi reads
        linear = lambda n_in, n_out, names: Linear(n_in, n_out, use_bias=False, dtype=dtype, rngs=rngs,
                                                   kernel_metadata=axes(*names))
        self.q_proj, self.k_proj = linear(d_model, H * K, COLUMNS), linear(d_model, H * K, COLUMNS)
        self.v_proj, self.o_proj = linear(d_model, d_model, COLUMNS), linear(d_model, d_model, ROWS)
        self.num_features = num_features or K
        if feature_map == "performer":
            self.features = RandomFeatures(orthogonal_random_features(rngs.params(), self.num_features, K))
        if feature_map == "hedgehog":
            eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (H, K, K))
            self.hedgehog_q, self.hedgehog_k = (nnx.Param(eye, **axes("heads", None, None)) for _ in range(2))
            self.hedgehog_q_bias, self.hedgehog_k_bias = (nnx.Param(jnp.zeros((H, K)), **axes("heads", None))
                                                          for _ in range(2))

    @property
    def feature_dim(self) -> int:
        d = self.qk_dim
        return {"performer": self.num_features, "cosformer": 2 * d, "hedgehog": 2 * d,
                "taylor": 1 + d + d * (d + 1) // 2}.get(self.feature_map, d)

    def redraw_features(self, key: jax.Array) -> None:
        """Performer only: draw a new random projection (between training steps; see the module doc)."""
        if self.feature_map != "performer":
            raise ValueError(f"redraw_features needs feature_map='performer', not {self.feature_map!r}")
        self.features[...] = orthogonal_random_features(key, self.num_features, self.qk_dim)

    def _phi(self, x: Float[Array, "B T H K"], pos: Int[Array, "B T"], is_query: bool) -> Float[Array, "B T H F"]:
        x = x.astype(jnp.float32)
        if self.feature_map == "identity":
            return x
        if self.feature_map == "elu":
            return jax.nn.elu(x) + 1.0
        if self.feature_map == "relu":
            return jax.nn.relu(x)
        if self.feature_map == "performer":
            x = x * self.qk_dim ** -0.25
            logits = jnp.einsum("bthk,mk->bthm", x, self.features[...]) - 0.5 * jnp.sum(x * x, -1, keepdims=True)
            if is_query and self.normalize:  # cancels between numerator and denominator
                logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
            return jnp.exp(logits) / math.sqrt(self.num_features)
        if self.feature_map == "cosformer":
            angle = (math.pi / (2 * self.cosformer_max_len)) * pos.astype(jnp.float32)[:, :, None, None]
            r = jax.nn.relu(x)
            return jnp.concatenate([r * jnp.cos(angle), r * jnp.sin(angle)], axis=-1)
        if self.feature_map == "taylor":
            x = x * self.qk_dim ** -0.25
            i, j = np.triu_indices(self.qk_dim)  # the symmetric half of x ⊗ x, diagonal included
            x2 = x[..., i] * x[..., j] * np.where(i == j, 2 ** -0.5, 1.0).astype(np.float32)
            return jnp.concatenate([jnp.ones_like(x[..., :1]), x, x2], axis=-1)
        w, b = (self.hedgehog_q, self.hedgehog_q_bias) if is_query else (self.hedgehog_k, self.hedgehog_k_bias)
        z = jnp.einsum("bthk,hkf->bthf", x, w[...]) + b[...]
        return jax.nn.softmax(jnp.concatenate([z, -z], axis=-1), axis=-1)

    def init_state(self, batch_size: int, max_len: int = 0) -> LinearAttentionState:
        """max_len is ignored: the state has a fixed size."""
        width = self.head_dim + int(self.normalize)
        S = jnp.zeros((batch_size, self.num_heads, self.feature_dim, width), jnp.float32)
        return LinearAttentionState(S=S, pos=jnp.zeros((batch_size,), jnp.int32))

    def _mix(self, x, state: LinearAttentionState, segment_ids, mode: str, steps: bool):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        x = x.astype(self.dtype)
        q, k = (p(x).reshape(B, T, H, self.qk_dim) for p in (self.q_proj, self.k_proj))  # (B, T, H, qk_dim)
        v = self.v_proj(x).reshape(B, T, H, K)  # (B, T, H, K)
        pos = positions_in_document(segment_ids, B, T, start=state.pos)  # (B, T)
        phi_q, phi_k = (self._phi(a, pos, is_query).astype(self.dtype) for a, is_query in ((q, True), (k, False)))
        if self.normalize:
            v = jnp.concatenate([v, jnp.ones((B, T, H, 1), v.dtype)], axis=-1)  # (B, T, H, K + 1)
        op = lambda S, q, k, v: linear_attention(q, k, v, segment_ids=segment_ids, initial_state=S,
                                                 output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                                 impl=self.impl)
        o, S = stepwise(op, state.S, phi_q, phi_k, v) if steps else op(state.S, phi_q, phi_k, v)
        o = o.astype(jnp.float32)
        if self.normalize:
            o = o[..., :K] / (o[..., K:] + self.eps)
        y = self.o_proj(o.reshape(B, T, H * K).astype(self.dtype))
        return y, (LinearAttentionState.stepped if steps else LinearAttentionState)(S=S, pos=per_token(pos + 1, steps))
