"""RWKV-7 "Goose" time mixing and channel mixing (Peng et al., 2025, "RWKV-7 'Goose' with Expressive
Dynamic State Evolution", arXiv:2503.14456), with the initialisation of the official code
(BlinkDL/RWKV-LM, RWKV-v7/train_temp/src/model.py: RWKV_Tmix_x070, RWKV_CMix_x070, and its
generate_init_weight, which re-initialises the projections), which the authors say the model needs.

Time mixing, per token (x_{t-1} is the previous token, zero at a document start):

    x^q = x_t + (x_{t-1} - x_t) * mu_q                                   q in {r, w, k, v, a, g}
    r = x^r W_r,  k = x^k W_k,  v = x^v W_v
    d = w0 + tanh(x^w w1) w2,     w = exp(-e^{-0.5} sigmoid(d))            decay in (0.545, 1)
    a = sigmoid(a0 + x^a a1 a2)                                          in-context learning rate
    v = lerp(v, v_first, sigmoid(v0 + x^v v1 v2))      value residual (layers after the first)
    g = sigmoid(x^g g1) g2                                               output gate
    kappa^ = normalize_per_head(k * xi)                                   removal key
    k~ = k * (1 + (a - 1) * alpha)                                       replacement key
    o = WKV7(r, log w, k~, v, a=-kappa^, b=kappa^ * a)   (kernels/wkv7; S_t = (diag(w) + b a^T) S + k v^T)
    y = ((GroupNorm_H(o) + ((r * k~ * rho) summed per head) v) * g) W_o

Channel mixing: y = relu(x^k W_k)^2 W_v with x^k = x + (x_{t-1} - x) * mu_k.

Code names -> paper symbols (-> official names):
    mu[0..5] -> mu_{r,w,k,v,a,g} (x_r, x_w, x_k, x_v, x_a, x_g);  decay_base/_a/_b -> w0, w1, w2;
    icl_base/_a/_b -> a0, a1, a2;  vres_base/_a/_b -> v0, v1, v2;  gate_a/_b -> g1, g2;
    removal_scale -> xi (k_k);  replace_rate -> alpha (k_a);  bonus -> rho (r_k);
    w_r, w_k, w_v, w_o -> W_r, W_k, W_v, W_o (receptance, key, value, output);  ln_* -> ln_x.

The value residual crosses layers, so RWKV7TimeMix departs from the plain mixer protocol in one
stated way: `carries_v_first = True`; `__call__(x, *, segment_ids, v_first) -> (y, v_first)` and
`decode(x, state, *, segment_ids, v_first) -> (y, state, v_first)`. The layer with layer_id 0 has
no value-residual parameters, ignores any v_first given and returns its own v (B, T, D); every later
layer needs that v_first (for the same tokens), mixes it in, and passes it through unchanged.

Initialisation (official; r0 = layer_id / (num_layers - 1), r1 = 1 - layer_id / num_layers, i the
channel, linear = i/(D-1) - 0.5, zigzag the signed square of the position inside the head in [-1, 1]):
mu_{r,w,k,v,a,g} = 1 - (i/D)^{(0.2, 0.9, 0.7, 0.7, 0.9, 0.2) r1}; w0 = -6 + 6 (i/(D-1))^{1 + r0^0.3}
+ 0.5 + 2.5 zigzag; a0 = -0.19 + 0.3 zigzag + 0.4 linear; v0 = 0.73 - 0.4 linear; every first LoRA
matrix 0, every second orthogonal * 0.1; xi = 0.71 - 0.1 linear; alpha = 1.02; rho = -0.04;
W_r, W_v orthogonal, W_k orthogonal * 0.1, W_o = 0; GroupNorm weight ((1+layer_id)/num_layers)^0.7.
LoRA ranks default to the official suggestions max(32, round(c sqrt(D) / 32) 32), c = 2.5 (decay,
icl), 1.7 (value residual), 5 (gate). Channel mix: mu_k = 1 - (i/D)^{r1^4}, W_k orthogonal, W_v = 0.

Departures from the official code, all deliberate:
- num_layers = 1 makes r0 = 0/0 there; here r0 = 0.
- GroupNorm eps = 1e-5 * head_dim (official 64e-5 at its fixed head size 64).
- Packed documents: the token shift reads zero at a document start and the WKV state restarts from
  zero, so a packed row equals its documents run alone.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kernels import check_impl, check_mode
from kernels.wkv7 import wkv7
from layers.linear import project
from layers.norm import head_group_norm
from layers.options import Impl, Mode, PosInt
from layers.rwkv_init import depth_ratios, orthogonal, param
from layers.state import stepwise
from layers.token_shift import RWKVChannelMix, RWKVTimeMix, RWKVTimeMixState, token_shift


def lora_rank(d_model: int, factor: float) -> int:
    """The official suggestion for a LoRA rank: max(32, round(factor * sqrt(D) / 32) * 32)."""
    return max(32, int(round(factor * math.sqrt(d_model) / 32) * 32))


class RWKV7TimeMix(RWKVTimeMix):
    """RWKV-7 "Goose" time mix (Peng et al. 2025): generalised delta rule with vector decay and in-context learning
    rate, value residual from layer 0 (see the module docstring for v_first); heads of head_dim; LoRA ranks
    decay_lora_dim, icl_lora_dim, value_lora_dim, gate_lora_dim (None = the official sizes). `mode` ("chunk",
    "recurrent" or "parallel") picks the WKV7 algorithm of __call__, chunk_size its chunk; decode uses "chunk" for T > 1
    and the recurrence for T = 1. `impl` ("auto", "reference", "xla", "pallas") picks the op's implementation on every
    path (kernels/wkv7: "pallas" runs the Pallas kernels of the platform, interpret mode on CPU). `layer_id` and
    `num_layers` (the model's) shape the depth-dependent initialisation. State: the previous token (B, D) and the WKV
    state (B, H, K, K), both float32; dtype: the compute dtype (parameters stay float32)."""

    carries_v_first = True

    def __init__(self, d_model: int, *, head_dim: PosInt = 64, layer_id: int = 0, num_layers: int = 1,
                 decay_lora_dim: PosInt | None = None, icl_lora_dim: PosInt | None = None,
                 value_lora_dim: PosInt | None = None, gate_lora_dim: PosInt | None = None, mode: Mode = "chunk",
                 chunk_size: PosInt = 64, impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if head_dim < 1 or d_model % head_dim:
            raise ValueError(f"head_dim={head_dim} does not divide d_model={d_model}")
        check_mode(mode, chunk_size, "RWKV7TimeMix")
        check_impl(impl, "RWKV7TimeMix")
        r0, r1 = depth_ratios(layer_id, num_layers)
        ranks = {name: lora_rank(d_model, c) if rank is None else rank for name, rank, c in (
            ("decay_lora_dim", decay_lora_dim, 2.5), ("icl_lora_dim", icl_lora_dim, 2.5),
            ("value_lora_dim", value_lora_dim, 1.7), ("gate_lora_dim", gate_lora_dim, 5.0))}
        for name, rank in ranks.items():
            if rank < 1:
                raise ValueError(f"{name}={rank} must be >= 1")
        D, H = d_model, d_model // head_dim
        self.num_heads, self.head_dim, self.layer_id = H, head_dim, layer_id
        self.mode, self.chunk_size, self.dtype, self.eps = mode, chunk_size, dtype, 1e-5 * head_dim
        self.impl, self.d_model = impl, d_model
        i = np.arange(D)  # the constant inits in numpy, cast once by `param`
        ddd = i / D
        linear = i / max(D - 1, 1) - 0.5
        z = ((i % head_dim) - (head_dim - 1) / 2) / max((head_dim - 1) / 2, 0.5)
        zigzag = z * np.abs(z)
        self.mu = param(np.stack([1.0 - ddd ** (e * r1) for e in (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)]))  # (6, D)

        def lora(rank, scale=0.1):  # (first, second): zeros, orthogonal * 0.1 (gain sqrt(rank/D) if rank > D)
            gain = math.sqrt(rank / D) if rank > D else 1.0
            return (param(np.zeros((D, rank)), "embed", None),
                    param(orthogonal(rngs.params(), (rank, D), gain * scale), None, "embed"))

        www = -6.0 + 6.0 * (i / max(D - 1, 1)) ** (1.0 + r0 ** 0.3)
        self.decay_base = param(www + 0.5 + 2.5 * zigzag)
        self.decay_a, self.decay_b = lora(ranks["decay_lora_dim"])
        self.icl_base = param(-0.19 + 0.3 * zigzag + 0.4 * linear)
        self.icl_a, self.icl_b = lora(ranks["icl_lora_dim"])
        if layer_id > 0:  # the first layer's v is v_first itself: no value residual there
            self.vres_base = param(0.73 - 0.4 * linear)
            self.vres_a, self.vres_b = lora(ranks["value_lora_dim"])
        self.gate_a, self.gate_b = lora(ranks["gate_lora_dim"])
        self.removal_scale = param(0.71 - 0.1 * linear)
        self.replace_rate = param(np.full(D, 1.02))
        self.bonus = param(np.full((H, head_dim), -0.04))
        self._init_rkv(D, rngs)
        self._init_out(D, layer_id, num_layers)

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None,
                 v_first: Float[Array, "B T D"] | None = None) -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
        """The protocol's, with layer 0's v beside the input and the output (module docstring)."""
        self._check(x, segment_ids)
        y, _, v_first = self._mix(x, self.init_state(x.shape[0], x.shape[1]), segment_ids, self.mode, False, v_first)
        return y, v_first

    def decode(self, x: Float[Array, "B T D"], state: RWKVTimeMixState, *,
               segment_ids: Int[Array, "B T"] | None = None, v_first: Float[Array, "B T D"] | None = None,
               steps: bool = False) -> tuple[Float[Array, "B T D"], RWKVTimeMixState, Float[Array, "B T D"]]:
        """steps=True returns the state after every token, for `rollback` (layers/state.py)."""
        self._check(x, segment_ids, steps)
        return self._mix(x, state, segment_ids, self._decode_mode(x.shape[1], steps), steps, v_first)

    def _mix(self, x, state: RWKVTimeMixState, segment_ids, mode: str, steps: bool, v_first):
        if self.layer_id > 0 and v_first is None:
            raise ValueError(f"RWKV7TimeMix(layer_id={self.layer_id}) needs v_first, the v returned by layer 0")
        B, T, D = x.shape
        H, K, dt = self.num_heads, self.head_dim, self.dtype
        p = lambda w: w[...].astype(dt)
        f32 = lambda y: y.astype(jnp.float32)
        x = x.astype(dt)
        prev, last = token_shift(x, state.shift, segment_ids, steps)
        xr, xw, xk, xv, xa, xg = x + (prev - x) * p(self.mu)[:, None, None]  # 6 x (B, T, D)
        r, k, v = project(xr, p(self.w_r)), project(xk, p(self.w_k)), project(xv, p(self.w_v))
        d = self.decay_base[...] + f32(jnp.tanh(xw @ p(self.decay_a)) @ p(self.decay_b))
        w_log = -math.exp(-0.5) * jax.nn.sigmoid(d)  # log w in (-e^{-0.5}, 0), float32
        if self.layer_id == 0:
            v_first = v
        else:
            v = v + (v_first.astype(dt) - v) * jax.nn.sigmoid(p(self.vres_base) + xv @ p(self.vres_a) @ p(self.vres_b))
        a = jax.nn.sigmoid(self.icl_base[...] + f32(xa @ p(self.icl_a) @ p(self.icl_b)))  # float32
        g = jax.nn.sigmoid(xg @ p(self.gate_a)) @ p(self.gate_b)
        heads = lambda y: y.reshape(B, T, H, K)  # (B, T, H, K)
        kappa = heads(f32(k) * self.removal_scale[...])
        # F.normalize: kappa / max(|kappa|, 1e-12), written so that a zero key has a zero gradient, not NaN
        kappa = kappa * jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(kappa), axis=-1, keepdims=True), 1e-24))
        k = f32(k) * (1.0 + (a - 1.0) * self.replace_rate[...])
        r, k, v, a = heads(r), heads(k), heads(v), heads(a)
        op = lambda S, r, w, k, v, a, b: wkv7(r, w, k, v, a, b, segment_ids=segment_ids, initial_state=S,
                                              output_final_state=True, mode=mode, chunk_size=self.chunk_size,
                                              impl=self.impl, max_decay=math.exp(-0.5))
        args = (state.wkv, r, heads(w_log), k, v, -kappa, kappa * a)
        o, wkv = stepwise(op, *args) if steps else op(*args)
        o = head_group_norm(o, self.ln_weight[...], self.ln_bias[...], self.eps)  # (B, T, D) float32
        o = o + (jnp.sum(f32(r) * k * self.bonus[...], axis=-1, keepdims=True) * f32(v)).reshape(B, T, D)
        y = project(o.astype(dt) * g, p(self.w_o))
        return y, (RWKVTimeMixState.stepped if steps else RWKVTimeMixState)(last, wkv), v_first


class RWKV7ChannelMix(RWKVChannelMix):
    """RWKV-7 channel mix: token-shifted squared-ReLU FFN (hidden_dim None = 4 D), with the mixer protocol for its
    state; layer_id / num_layers (the model's) shape its initialisation; dtype: the compute dtype (parameters stay
    float32)."""

    def __init__(self, d_model: int, *, hidden_dim: PosInt | None = None, layer_id: int = 0, num_layers: int = 1,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        hidden_dim = 4 * d_model if hidden_dim is None else hidden_dim
        _, r1 = depth_ratios(layer_id, num_layers)
        self._init_ffn(d_model, hidden_dim, 1.0 - (np.arange(d_model) / d_model) ** (r1 ** 4), dtype, rngs)
