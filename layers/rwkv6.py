"""RWKV-6 "Finch" time mixing and channel mixing (Peng et al., 2024, "Eagle and Finch: RWKV with
Matrix-Valued States and Dynamic Recurrence", arXiv:2404.05892), with the official initialisation
of BlinkDL/RWKV-LM (RWKV-v5/src/model.py, RWKV_Tmix_x060 / RWKV_CMix_x060 and generate_init_weight).

Time mixing, per token (x_{t-1} is the previous token, zero at a document start):

    lora_q(x)      = lambda_q + tanh(x A_q) B_q
    ddlerp_q(a, b) = a + (b - a) * lora_q(a + (b - a) * mu_x)          q in {w, k, v, r, g}
    r, k, v = ddlerp_{r,k,v}(x_t, x_{t-1}) W_{r,k,v},   g = silu(ddlerp_g(x_t, x_{t-1}) W_g)
    d_t = lora_d(ddlerp_w(x_t, x_{t-1})),   w_t = exp(-exp(d_t))
    o_t = WKV6(r, k, v, w, u)  (kernels/wkv6),   y = (GroupNorm_H(o) * g) W_o

Channel mixing:  k = relu(lerp_k W_k)^2,  y = sigmoid(lerp_r W_r) * (k W_v),  lerp_q = x + (x_{t-1} - x) mu_q.

Code names -> paper symbols (-> official names):
    mu_x -> mu_x (time_maa_x);  mu[0..4] -> lambda_{w,k,v,r,g} of the mix LoRA (time_maa_{w,k,v,r,g});
    mix_a, mix_b -> A, B of the five mix LoRAs, stacked (time_maa_w1, time_maa_w2);
    decay_base, decay_a, decay_b -> lambda_d, A_d, B_d (time_decay, time_decay_w1, time_decay_w2);
    bonus -> u (time_faaaa);  w_r, w_k, w_v, w_g, w_o -> W_r, W_k, W_v, W_g, W_o;
    ln_weight, ln_bias -> the per-head GroupNorm (ln_x).

Initialisation (official; layer_id/num_layers set the depth ratios r0 = layer_id / (num_layers - 1),
r1 = 1 - layer_id / num_layers): mu's = 1 - (i/D)^{r1} (v: minus 0.3 r0 more; r, g: exponent r1/2),
A = 0, B ~ U(-0.01, 0.01), lambda_d = -6 + 5 (i/(D-1))^{0.7 + 1.3 r0}, u = r0 (1 - i/(D-1)) + zigzag,
W_r, W_v orthogonal, W_k, W_g orthogonal * 0.1, W_o = 0, GroupNorm weight ((1+layer_id)/num_layers)^0.7.
Channel mix: mu_k = mu_r = 1 - (i/D)^{r1}, W_k orthogonal, W_r = W_v = 0.

Departures from the official code, all deliberate:
- num_layers = 1 makes r0 = 0/0 there; here r0 = 0.
- GroupNorm eps = 1e-5 * head_dim (official: 1e-5 * head_size_divisor^2 = 64e-5, equal at head_dim 64).
- Channel-mix hidden size: 3.5 d_model rounded down to a multiple of 32 as official, but at least 32.
- Packed documents: the token shift reads zero at a document start (as at the sequence start) and
  the WKV state restarts from zero, so a packed row equals its documents run alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels import check_impl, check_mode
from kernels.wkv6 import wkv6
from layers.linear import project
from layers.norm import head_group_norm
from layers.options import Impl, Mode, PosInt
from layers.rwkv_init import depth_ratios, orthogonal, param
from layers.sharding import COLUMNS
from layers.state import stepwise
from layers.token_shift import RWKVChannelMix, RWKVTimeMix, RWKVTimeMixState, token_shift


class RWKV6TimeMix(RWKVTimeMix):
    """RWKV-6 "Finch" time mix (Peng et al. 2024): data-dependent token shift (LoRA of mix_lora_dim) and decay (LoRA of
    decay_lora_dim), bonus u, heads of head_dim. `mode` ("chunk", "recurrent" or "parallel") picks the WKV6 algorithm of
    __call__, chunk_size its chunk; decode uses "chunk" for T > 1 and the recurrence for T = 1. `impl` ("auto",
    "reference", "xla", "pallas") picks the op's implementation on every path (kernels/wkv6: "pallas" runs the GLA
    Pallas kernels of the platform on shifted inputs). `layer_id` (default 0) and `num_layers` (default 1, the model's)
    only shape the official depth-dependent initialisation. State: the previous token (B, D) and the WKV state (B, H, K,
    K), both float32; dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, head_dim: PosInt = 64, layer_id: int = 0, num_layers: int = 1,
                 mix_lora_dim: PosInt = 32, decay_lora_dim: PosInt = 64, mode: Mode = "chunk", chunk_size: PosInt = 64,
                 impl: Impl = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if head_dim < 1 or d_model % head_dim:
            raise ValueError(f"head_dim={head_dim} does not divide d_model={d_model}")
        if mix_lora_dim < 1 or decay_lora_dim < 1:
            raise ValueError(f"mix_lora_dim={mix_lora_dim} and decay_lora_dim={decay_lora_dim} must be >= 1")
        check_mode(mode, chunk_size, "RWKV6TimeMix")
        check_impl(impl, "RWKV6TimeMix")
        r0, r1 = depth_ratios(layer_id, num_layers)
        D, H = d_model, d_model // head_dim
        self.num_heads, self.head_dim, self.mode, self.chunk_size, self.dtype = H, head_dim, mode, chunk_size, dtype
        self.impl, self.d_model = impl, d_model
        self.eps = 1e-5 * head_dim
        ddd = np.arange(D) / D  # the constant inits in numpy, cast once by `param`
        n = np.arange(D) / max(D - 1, 1)
        self.mu_x = param(1.0 - ddd ** r1)
        self.mu = param(np.stack([1.0 - ddd ** r1, 1.0 - ddd ** r1, 1.0 - (ddd ** r1 + 0.3 * r0),
                                  1.0 - ddd ** (0.5 * r1), 1.0 - ddd ** (0.5 * r1)]))  # (5, D): w k v r g
        self.mix_a = param(np.zeros((D, 5 * mix_lora_dim)), "embed", None)
        self.mix_b = param(jax.random.uniform(rngs.params(), (5, mix_lora_dim, D), jnp.float32, -0.01, 0.01),
                           None, None, "embed")
        self.decay_base = param(-6.0 + 5.0 * n ** (0.7 + 1.3 * r0))
        self.decay_a = param(np.zeros((D, decay_lora_dim)), "embed", None)
        self.decay_b = param(jax.random.uniform(rngs.params(), (decay_lora_dim, D), jnp.float32, -0.01, 0.01),
                             None, "embed")
        zigzag = ((np.arange(D) + 1) % 3 - 1) * 0.1
        self.bonus = param((r0 * (1.0 - n) + zigzag).reshape(H, head_dim))
        self._init_rkv(D, rngs)
        self.w_g = param(orthogonal(rngs.params(), (D, D), 0.1), *COLUMNS)
        self._init_out(D, layer_id, num_layers)

    def _mix(self, x, state: RWKVTimeMixState, segment_ids, mode: str, steps: bool):
        B, T, D = x.shape
        H, K, dt = self.num_heads, self.head_dim, self.dtype
        p = lambda w: w[...].astype(dt)
        x = x.astype(dt)
        prev, last = token_shift(x, state.shift, segment_ids, steps)
        xx = prev - x  # (B, T, D)
        m = jnp.tanh((x + xx * p(self.mu_x)) @ p(self.mix_a)).reshape(B, T, 5, -1)
        m = jnp.einsum("BTFR,FRD->FBTD", m, p(self.mix_b)) + p(self.mu)[:, None, None]  # (5, B, T, D)
        xw, xk, xv, xr, xg = x + xx * m
        heads = lambda y: y.reshape(B, T, H, K)  # (B, T, H, K)
        r, k, v = heads(project(xr, p(self.w_r))), heads(project(xk, p(self.w_k))), heads(project(xv, p(self.w_v)))
        g = jax.nn.silu(project(xg, p(self.w_g)))
        d = self.decay_base[...] + (jnp.tanh(xw @ p(self.decay_a)) @ p(self.decay_b)).astype(jnp.float32)
        op = lambda S, r, k, v, w: wkv6(r, k, v, w, self.bonus[...], segment_ids=segment_ids, initial_state=S,
                                        output_final_state=True, mode=mode, chunk_size=self.chunk_size, impl=self.impl)
        args = (state.wkv, r, k, v, heads(-jnp.exp(d)))
        o, wkv = stepwise(op, *args) if steps else op(*args)
        o = head_group_norm(o, self.ln_weight[...], self.ln_bias[...], self.eps).astype(dt)
        return project(o * g, p(self.w_o)), (RWKVTimeMixState.stepped if steps else RWKVTimeMixState)(last, wkv)


class RWKV6ChannelMix(RWKVChannelMix):
    """RWKV-6 channel mix: token-shifted squared-ReLU FFN with a receptance gate (hidden_dim None = 3.5 D). It shifts
    tokens too, so it carries a decode state and follows the mixer protocol: __call__(x, *, segment_ids),
    init_state(batch_size, max_len), decode(...); layer_id / num_layers (the model's) shape its initialisation; dtype:
    the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, hidden_dim: PosInt | None = None, layer_id: int = 0, num_layers: int = 1,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        hidden_dim = max(32, int(d_model * 3.5) // 32 * 32) if hidden_dim is None else hidden_dim
        _, r1 = depth_ratios(layer_id, num_layers)
        mu = 1.0 - (np.arange(d_model) / d_model) ** r1
        self._init_ffn(d_model, hidden_dim, mu, dtype, rngs)
        self.mu_r = param(mu)
        self.w_r = param(np.zeros((d_model, d_model)), "embed", None)

    def _gate(self, x, prev, y):
        """The receptance gate."""
        return jax.nn.sigmoid(project(x + (prev - x) * self._p(self.mu_r), self._p(self.w_r))) * y
