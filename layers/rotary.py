"""Rotary position embeddings (Su et al., 2021, RoFormer), the rotate-half layout of GPT-NeoX/Llama.

    x'_i       = m (x_i cos(p θ_i) - x_{i+D/2} sin(p θ_i))     θ_i = base^(-2i/D)
    x'_{i+D/2} = m (x_i sin(p θ_i) + x_{i+D/2} cos(p θ_i))

with m = 1 and the θ_i above unless a `RopeScaling` stretches them for a longer context, as the
Hugging Face checkpoints that use it were trained (transformers' rope types of the same names):
- linear (position interpolation, Chen et al. 2023): every θ_i / factor;
- llama3 (Llama 3.1): θ_i / factor for wavelengths longer than original_max_position_embeddings /
  low_freq_factor, θ_i kept below original_max_position_embeddings / high_freq_factor, a smooth
  blend between;
- yarn (Peng et al. 2023): a ramp between interpolated (θ_i / factor) and kept frequencies over
  the dimensions whose rotations in the original context lie between beta_slow and beta_fast, and
  m = attention_factor (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio);
- dynamic (transformers' dynamic NTK): the plain θ_i within original_max_position_embeddings, which
  is all a fixed rotary can honour: past it transformers re-derives the base from the running length,
  so layers/attention.py refuses longer sequences and caches under this type.

Partial rotary (`rotary_dim` r < K, transformers' partial_rotary_factor = r / K: GPT-NeoX, Phi, Qwen3-Next):
the formulas above on the first r dims of each head, D replaced by r (θ_i = base^(-2i/r), and r in
every scaling's formulas, as transformers computes them), rotate-half inside those r dims; dims r..K-1
pass unrotated (m does not touch them). GLM's interleaved pairs (2i, 2i+1) are a permutation of these.
"""

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from layers.options import PosFloat, PosInt


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """attention.rope_scaling: a rotary scaling (type linear, llama3, yarn or dynamic) and that type's keys;
    the fields a type does not use are ignored."""
    type: Literal["linear", "llama3", "yarn", "dynamic"] = "linear"
    factor: PosFloat = 1.0
    original_max_position_embeddings: PosInt = 8192  # llama3, yarn, dynamic: the base model's context
    low_freq_factor: PosFloat = 1.0  # llama3
    high_freq_factor: PosFloat = 4.0  # llama3
    beta_fast: PosFloat = 32.0  # yarn
    beta_slow: PosFloat = 1.0  # yarn
    attention_factor: PosFloat | None = None  # yarn: None = from factor, mscale and mscale_all_dim
    mscale: PosFloat | None = None  # yarn
    mscale_all_dim: PosFloat | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None
                     ) -> tuple[np.ndarray, float]:
    """(θ (head_dim / 2,) float32, the cos/sin multiplier m), for the formulas above."""
    half = head_dim // 2
    inv_freq = (1.0 / base ** (np.arange(half, dtype=np.float32) * 2 / head_dim)).astype(np.float32)
    if scaling is None:
        return inv_freq, 1.0
    s = scaling
    if s.type == "dynamic":  # exact only within the original context, where it is the plain rotary
        return inv_freq, 1.0
    if s.type == "linear":
        return inv_freq / np.float32(s.factor), 1.0
    if s.type == "llama3":
        wavelen = 2 * math.pi / inv_freq
        context = s.original_max_position_embeddings
        low, high = context / s.low_freq_factor, context / s.high_freq_factor
        scaled = np.where(wavelen > low, inv_freq / s.factor, inv_freq)
        smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high) & (wavelen <= low)
        return np.where(medium, blended, scaled).astype(np.float32), 1.0
    # yarn
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    factor = s.attention_factor
    if factor is None:
        factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim) if s.mscale and s.mscale_all_dim \
            else mscale(s.factor)
    dim_of = lambda rotations: head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) \
        / (2 * math.log(base))
    lo, hi = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    keep = 1 - np.clip((np.arange(half, dtype=np.float32) - lo) / (hi - lo), 0, 1)  # 1: the original frequency
    return (inv_freq / s.factor * (1 - keep) + inv_freq * keep).astype(np.float32), float(factor)


def apply_rotary(x: Float[Array, "B T H K"], positions: Int[Array, "B T"], base: float = 10000.0,
                 scaling: RopeScaling | None = None, rotary_dim: int | None = None):
    """x with its first rotary_dim dims of each head rotated (None: all K), the rest unchanged."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq, m = rope_frequencies(r, base, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, r/2)
    cos, sin = (m * f(angles)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    turned = _turn(x[..., :r].astype(jnp.float32), cos, sin).astype(x.dtype)
    return turned if r == x.shape[-1] else jnp.concatenate([turned, x[..., r:]], axis=-1)  # (B, T, H, K)


@jax.custom_vjp
def _turn(x, cos, sin):
    """The rotate-half turn of x (..., r) by angles with cos, sin (..., r/2). Its gradient is the turn
    back (cos, -sin), from the cos and sin of the forward pass: autodiff's recomputed both inside each
    fusion of the backward (B=8, T=256, 4 heads of 32, q and k, forward+backward: 2.4 -> 1.5 ms on the
    2-core EPYC, 2026-12-07). Positions have no gradient, so cos and sin get zeros."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


_turn.defvjp(lambda x, cos, sin: (_turn(x, cos, sin), (cos, sin)),
             lambda res, g: (_turn(g, res[0], -res[1]), jnp.zeros_like(res[0]), jnp.zeros_like(res[1])))
