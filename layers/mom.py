"""Mixture of Memories token mixer (Du et al. 2025, "MoM: Linear Sequence Modeling with Mixture-of-Memories",
arXiv 2502.13685), as flash-linear-attention's `MomAttention` layer computes it with its gated_deltanet
backend (fla's only one). A router sends each token to top_k of M memories, each a Gated DeltaNet state
(layers/deltanet.py) with its own key, value, write-strength and decay projections; an always-on shared
memory, written by every token, is added. Per head, for memory m (m = M + 1: the shared one):

    p_t = softmax(x_t W_r),  R_t = TopK(p_t, top_k),  w^m_t = p^m_t / sum_{j in R_t} p^j_t  (m in R_t; else 0)
    q_t = norm(SiLU(conv(W_q x)_t)),  k^m_t = norm(SiLU(conv_k^m(W_k^m x)_t)),  v^m_t = SiLU(conv_v^m(W_v^m x)_t)
    beta^m_t = sigmoid(w_b^m . x_t),  alpha^m_t = exp(-exp(A_log) * softplus(w_a^m . x_t + dt_bias))
    m routed (m in R_t, or the shared memory):
        S^m_t = alpha^m_t (I - beta^m_t k^m_t k^m_t^T) S^m_{t-1} + beta^m_t k^m_t v^m_t^T
    otherwise:  S^m_t = S^m_{t-1}
    o_t = sum_{m in R_t} w^m_t S^m_t^T q_t / sqrt(K)  +  S^{M+1}_t^T q_t / sqrt(K)
    y_t = W_o [RMSNorm(o_t) * SiLU(W_g x_t)]          (norm = L2; no output gate: W_o RMSNorm(o_t))

The op (kernels/mom) runs the memories as extra heads of one delta-rule call, beta and the log-decay masked
to 0 where a token is not routed (exactly "left unchanged"), so every mode and implementation of the
delta-rule op serves, with packed documents, states and decoding. Routing is computed outside the op, per
token, so every mode, the decode step and a packed row route alike.

Load balance (training only, as fla's model adds it to the loss): balance_loss = M sum_m f_m P_m, f_m the
fraction of the call's tokens routed to memory m, P_m the mean router probability (fla's
load_balancing_loss_func: uniform routing gives top_k), sown as nnx.Intermediate "mom" with
aux_loss = balance_loss_weight * balance_loss, which train/step.py adds to the loss (as layers/moe.py's
"moe"). It is sown only while `deterministic` is False: model.train() (which train/step.py calls every step)
sets it, model.eval() and nnx.view(deterministic=True) clear it; decode never sows. The layer starts with
deterministic=True (MoE starts False): a sow mutates the module, which a plain call under a JAX transform
of a closure (jax.eval_shape(lambda x: layer(x), x)) cannot do, and a mixer is called so everywhere.

Code names: `num_memories` M, `top_k`, `shared_memory` the always-on memory, `router` W_r (fla's `gate`),
`q_proj` W_q (one, shared by the memories, as fla), `k_proj` / `v_proj` / `b_proj` / `a_proj` the E = M (+ 1)
memories' W_k^m / W_v^m / w_b^m / w_a^m stacked (memory-major), `A_log`, `dt_bias` per head and shared by
the memories (as fla), `g_proj` W_g, `o_norm`, `o_proj` W_o; `num_heads` H, `head_dim` K, `expand_v` V / K.
Decode state: the E delta-rule states (B, E, H, K, V) float32 and the short convolutions' windows (q: H K
channels; k, v: every memory's, E H K and E H V).

Departures from fla, named:
- Short convolutions run over the token sequence (a memory's key at t reads x_{t-conv_size+1..t}, routed or
  not), each memory's k and v with their own taps; fla gathers each memory's tokens first and convolves that
  compacted stream with one q, k and v convolution shared by the memories (in training without sequence
  boundaries, so its taps also cross from one memory's tokens, or one row's, to the next). The query is
  therefore the same for every memory here (fla: it differs by memory through the compacted convolution).
- The masked form computes every memory over every token: E / (top_k + 1) times fla's delta-rule work (which
  gathers each memory's tokens; E / top_k without the shared memory), for fixed shapes and an exact decode /
  packed path.
- The balance loss is per layer and summed over layers, as layers/moe.py (fla: one loss over all layers'
  router logits pooled); every token of the call counts, padding included.
- Not offered: fla's single_kv_proj (one k/v/beta/decay projection for all memories) and `capacity`
  (accepted and unused by fla); the key width is `head_dim` (default d_model / num_heads; fla: 256);
  expand_v defaults to 1 (fla's model config; its layer: 2). top_k = 1 renormalises the weight to 1, so
  the router then learns through the balance loss alone (as fla). Initialisation: the zoo's Linear default
  (fla: xavier_uniform, gain 2^-2.5); A_log, dt_bias as Gated DeltaNet.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kernels.mom import mom
from layers.conv import init_windows
from layers.deltanet import DeltaNetState, DeltaRuleMixer, decay_params, gate_proj, normalize_qk
from layers.linear import Linear
from layers.options import Impl, Mode, NonNegFloat, NonNegInt, PosFloat, PosInt
from layers.sharding import axes
from layers.state import state


@state
class MoMState(DeltaNetState):  # a DeltaNetState, as DeltaRuleMixer._mix takes
    recurrent: Float[Array, "B E H K V"]  # (B, E, H, K, V) float32: every memory's delta-rule state
    conv_q: Float[Array, "B W H*K"] | None  # (B, conv_size - 1, H*K); None when conv_size = 0
    conv_k: Float[Array, "B W E*H*K"] | None  # (B, conv_size - 1, E*H*K): every memory's keys
    conv_v: Float[Array, "B W E*H*V"] | None  # (B, conv_size - 1, E*H*V)


class MixtureOfMemories(DeltaRuleMixer):
    """Mixture of Memories (Du et al. 2025, MoM): a router sends each token to top_k of num_memories Gated DeltaNet
    memories (own k, v, beta and decay projections), plus an always-on memory (shared_memory); the output mixes the
    memories' read-outs by the renormalised router weights (module docstring); balance_loss_weight: the load-balance
    loss added in training (fla's aux_loss_scale); head_dim None = d_model / num_heads, expand_v, conv_size,
    use_output_gate, norm_eps as Gated DeltaNet's; mode ("recurrent" | "chunk" | "parallel") picks the training path's
    exact form, chunk_size its chunk; impl ("auto" | "reference" | "xla" | "pallas") picks the op's implementation on
    every path; dtype: the compute dtype (parameters stay float32)."""

    context_parallel = False  # its routed memories: no form yet (kernels/context.py)

    State = MoMState

    def __init__(self, d_model: int, *, num_heads: PosInt = 4, head_dim: PosInt | None = None, expand_v: PosFloat = 1.0,
                 num_memories: PosInt = 4, top_k: PosInt = 2, shared_memory: bool = True,
                 balance_loss_weight: NonNegFloat = 0.01, conv_size: NonNegInt = 4, use_output_gate: bool = True,
                 norm_eps: PosFloat = 1e-5, mode: Mode = "chunk", chunk_size: PosInt = 64, impl: Impl = "auto",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if num_memories < 1:
            raise ValueError(f"num_memories={num_memories} must be >= 1")
        if not 1 <= top_k <= num_memories:
            raise ValueError(f"top_k={top_k} must be between 1 and num_memories={num_memories}")
        E = num_memories + int(shared_memory)
        super().__init__(d_model, num_heads=num_heads, head_dim=head_dim, expand_v=expand_v, conv_size=conv_size,
                         use_output_gate=use_output_gate, qk_norm="l2", norm_eps=norm_eps, mode=mode,
                         chunk_size=chunk_size, impl=impl, dtype=dtype, rngs=rngs,
                         num_householder=E)  # k_proj, v_proj and their convs: E memories' stacked
        self.num_memories, self.top_k, self.shared_memory = num_memories, top_k, shared_memory
        self.balance_loss_weight, self.deterministic = balance_loss_weight, True  # model.train(): False
        H = self.num_heads
        self.router = Linear(d_model, num_memories, use_bias=False, dtype=jnp.float32, rngs=rngs,
                             kernel_metadata=axes("embed", None))
        self.a_proj, self.b_proj = gate_proj(d_model, E * H, dtype, rngs), gate_proj(d_model, E * H, dtype, rngs)
        self.A_log, self.dt_bias = decay_params(rngs, H, H, A_low=0.0)

    def set_view(self, deterministic: bool | None = None):
        """Lets `nnx.view(model, deterministic=...)` make a train/eval view without mutating model."""
        if deterministic is not None:
            self.deterministic = deterministic

    def init_state(self, batch_size: int, max_len: int = 0) -> MoMState:
        """A zero state; max_len is accepted and ignored (the state does not grow with context)."""
        E, H, K, V = self.num_householder, self.num_heads, self.head_dim, self.value_dim
        recurrent = jnp.zeros((batch_size, E, H, K, V), jnp.float32)
        return MoMState(recurrent, *init_windows(self._convs(), batch_size, self.dtype))

    def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None
                 ) -> Float[Array, "B T D"]:
        y = super().__call__(x, segment_ids=segment_ids)
        if not self.deterministic:  # training: the load-balance loss, for train/step.py
            self._record(self._router_probs(x.astype(self.dtype)))
        return y

    def _router_probs(self, x: Float[Array, "B T D"]) -> Float[Array, "B T _M"]:
        return jax.nn.softmax(self.router(x.astype(jnp.float32)), axis=-1)  # (B, T, num_memories) float32

    def _route(self, x: Float[Array, "B T D"]) -> tuple[Bool[Array, "B T E"], Float[Array, "B T E"]]:
        """Which memories each token writes and their mixing weights, (B, T, E): the top_k renormalised, then
        the shared memory with weight 1."""
        top, chosen = jax.lax.top_k(self._router_probs(x), self.top_k)  # (B, T, top_k)
        one_hot = jax.nn.one_hot(chosen, self.num_memories, dtype=jnp.float32)  # (B, T, top_k, M)
        if self.top_k == 1:  # the renormalised weight is 1: exactly, so the router's gradient is exactly 0
            weights = one_hot[:, :, 0]
        else:
            weights = jnp.einsum("BTk,BTkM->BTM", top / jnp.sum(top, axis=-1, keepdims=True), one_hot)
        routed = jnp.sum(one_hot, axis=2) > 0  # (B, T, M)
        if self.shared_memory:
            routed = jnp.concatenate([routed, jnp.ones_like(routed[..., :1])], axis=-1)  # (B, T, E)
            weights = jnp.concatenate([weights, jnp.ones_like(weights[..., :1])], axis=-1)
        return routed, weights

    def _record(self, probs: Float[Array, "B T _M"]):
        """Sow the load-balance loss (module docstring) and the routing's statistics."""
        M = self.num_memories
        chosen = jax.lax.top_k(probs, self.top_k)[1]
        load = jnp.sum(jax.nn.one_hot(chosen, M, dtype=jnp.float32), axis=2).reshape(-1, M)  # (N, M)
        f = jax.lax.stop_gradient(jnp.mean(load, axis=0))  # fraction of tokens routed to each memory
        P = jnp.mean(probs.reshape(-1, M), axis=0)
        balance_loss = M * jnp.sum(f * P)
        self.sow(nnx.Intermediate, "mom", {
            "aux_loss": self.balance_loss_weight * balance_loss, "balance_loss": balance_loss,
            "tokens_per_memory": f, "router_probs": jax.lax.stop_gradient(P)})

    def _recurrence(self, q, k, v, x, segment_ids, mode):
        """The memories' op (kernels/mom) and its per-token inputs, from the convolved q (B, T, H, K),
        k (B, T, E, H, K), v (B, T, E, H, V) and the layer's input x."""
        B, T, E, H, _ = k.shape
        q, k = normalize_qk(q, "l2"), normalize_qk(k, "l2")
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)).reshape(B, T, E, H)  # (B, T, E, H)
        a = self.a_proj(x).astype(jnp.float32).reshape(B, T, E, H) + self.dt_bias[...]  # (B, T, E, H)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a)  # log alpha^m_t
        routed, weights = self._route(x)
        op = lambda S, q, k, v, beta, g, routed, weights: mom(
            q, k, v, beta, g, routed, weights, segment_ids=segment_ids, initial_state=S, output_final_state=True,
            mode=mode, chunk_size=self.chunk_size, impl=self.impl)
        return op, (q, k, v, beta, g, routed, weights)
