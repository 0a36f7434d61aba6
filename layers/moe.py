"""Mixture-of-Experts SwiGLU feed-forward: token-choice top-k (Shazeer et al., 2017; GShard, Lepikhin
et al., 2020; Mixtral, Jiang et al., 2024), Switch top-1 (Fedus et al., 2021), expert choice (Zhou et
al., 2022), shared and fine-grained experts (DeepSeekMoE, Dai et al., 2024), auxiliary-loss-free
balancing (DeepSeek-V3, 2024), capacity-based or dropless (grouped-matmul, MegaBlocks, Gale et al.,
2022) dispatch.

For the N = B*T tokens x_n (rows of `xf`), router logits l = x W_r in float32 (`logits`, (N, E)),
scores p = softmax(l) (`scoring="softmax"`, the default) or p = sigmoid(l) (`scoring="sigmoid"`,
DeepSeek-V3's affinities; `scores`). Each expert e is a SwiGLU MLP (layers/mlp.py) with stacked weights
`w_gate`, `w_up` (E, D, F) and `w_down` (E, F, D):  FFN_e(x) = (silu(x W_g^e) * x W_u^e) W_d^e; `activation`
takes the MLP's other forms: geglu (gelu_tanh for silu) or relu2, FFN_e(x) = relu(x W_u^e)^2 W_d^e without
w_gate (Nemotron-H's experts), for the routed and the shared experts alike.

    y_n = routed_scale * sum_{e in S_n} g_{n,e} FFN_e(x_n)  +  sum_{s < num_shared_experts} FFN_s^shared(x_n)

(routed_scale: DeepSeek-V3's routed_scaling_factor, 1 by default.)

The shared experts are one MLP of width num_shared_experts * F (`shared`), which is exactly the sum of
that many width-F experts, or of width shared_hidden_dim when set; with shared_gate (Qwen2-MoE) their
sum is scaled per token by sigmoid(x w_sg) (`w_shared_gate`, (D, 1), zero at init: a gate of 1/2).
hidden_dim=None gives F = default_expert_dim(d_model, top_k + num_shared_experts): the dense MLP's
width divided by the experts active per token, rounded up to a multiple of 8 (fine-grained experts
with the dense model's active parameters; top_k=1: full width).

Token choice (`router="topk"`), S_n = the k = top_k experts of the selection scores:
  score_order="softmax_then_topk": S_n = TopK(p_n + b), g = p_{n,S_n} (divided by its sum when
      renormalize=True, the same gates as Mixtral's top-k-then-softmax; raw as GShard when False);
  score_order="topk_then_softmax": S_n = TopK(l_n + b), g = softmax(l_{n,S_n}) (Mixtral's code; the
      gates already sum to 1, `renormalize` does not apply).
  top_k=1 with gates that sum to 1 (renormalized or topk_then_softmax) gives g == 1 and no gradient
  to the router from the task loss, so that configuration is refused: use router="switch".
  With sigmoid scores only score-then-choose applies (score_order="softmax_then_topk", the p above).
Group-limited choice (DeepSeek-V3's node-limited routing, `num_groups` > 1, topk and switch): the E
  experts form num_groups equal groups in index order; a group's score is the sum of its two highest
  selection scores (p_n + b; its one score for groups of one expert), the `top_groups` best groups of
  each token are kept and TopK above picks among their experts only (the others' scores are -inf).
Switch (`router="switch"`, top_k must be 1): S_n = argmax(p_n + b), g = p_{n,S_n} (not renormalized,
  so the router learns through the gate); score_order and renormalize do not apply.
Expert choice (`router="expert_choice"`): each expert picks its C highest-scoring tokens of the whole
  batch: G, I = TopK(p^T, C) over the N tokens, y_n = sum_{e: n in I_e} G_{e,n} FFN_e(x_n) (no
  renormalization). A token can get 0 or up to E experts. It looks across the batch and the sequence,
  so it is NOT causal: a token's output depends on later tokens (and on other rows). Outside
  training (deterministic, see below) and in any call with T == 1 it routes by token-choice top-k on
  the same scores (S_n = TopK(p_n), g = p_{n,S_n}, dropless), so evaluation and generation are causal
  and the same function, but see a different router than training did. score_order, renormalize
  and dispatch do not apply; balance="bias" is refused (every expert already takes exactly C tokens).

Capacity (dispatch="capacity", and expert choice): C = min(N, ceil(capacity_factor * N * k / E))
  (Zhou et al.'s "capacity factor c" is our top_k * capacity_factor). Token-choice assignments are
  queued choice-major: all first choices in flattened (b, t) order, then all second choices, ... (the
  Mesh-TF/T5X Switch/GShard priority). An expert keeps the first C assignments of its queue; a dropped
  assignment contributes exactly zero (in a residual block the token passes through unchanged). Each
  expert multiplies its (E, C, D) buffer, padding included; on CPU (float32, one device) kernels/grouped
  multiplies the kept assignments alone instead (at most k*N rows against the buffers' E*C).
dispatch="dropless": assignments are stably sorted by expert (the same queue order), each expert's
  group is padded to whole tiles of `tile` rows, and every tile is multiplied by its own expert's
  weights in one batched product (MegaBlocks' block-sparse layout, Gale et al., 2022, with static
  shapes: at most k*N/tile + E tiles). Nothing is dropped, and it equals capacity dispatch whenever
  capacity drops nothing. The work is k*N rows plus at most E tiles of padding, where
  `jax.lax.ragged_dot` on CPU (wherever XLA has no native ragged dot) is a masked dense product over
  all E groups, E times the FLOPs. On CPU (float32, one device) the products are kernels/grouped's
  instead: each expert's rows times its weights, no tiles (benchmarks/peers.py: moe_dropless).
Outside training, dispatch is always dropless. Which assignments capacity drops depends on every
  other token of the call (other rows, other documents, later tokens), so capacity dispatch is not
  a causal function of a row: with it, validation loss, a packed batch and token-by-token decoding
  would each see a different model. Dropless is one function of each token, whatever the batch, so
  evaluation, packed rows and decoding agree exactly; `dispatch` is training's choice (capacity:
  GShard/Switch's fixed buffers; dropless: MegaBlocks). A training-mode call with T == 1 is dropless
  too.

Losses (sown, float32). f_e = (assignments routed to e before dropping) / (N k), P_e = mean_n p_{n,e}
  (with sigmoid scores p normalised to sum 1 per token, DeepSeek-V3's s'; so in the entropy too):
  balance_loss = E sum_e f_e P_e (Switch's loss with all k choices counted, = DeepSeek's L_ExpBal /
      alpha; = 1 under uniform routing, f = P = 1/E, where Switch's loss is minimised);
  z_loss = mean_n (logsumexp_e l_{n,e})^2 (ST-MoE, Zoph et al., 2022);
  aux_loss = balance_loss_weight * balance_loss [only with balance="aux_loss"] + z_loss_weight * z_loss.
balance="bias" (DeepSeek-V3): a per-expert bias b (`RouterBias`, not a Param; a checkpoint's
  e_score_correction_bias) is added to the scores for selection only (never to the gates) and, after
  each training forward, b_e += bias_update_rate * sign(mean_e(load) - load_e), load =
  tokens_per_expert, outside the gradient.
Router jitter (Switch): in training, the router's input (not the experts') is multiplied by
  U(1 - router_jitter, 1 + router_jitter), drawn from the "jitter" stream of `rngs` (else "default").

Train vs eval: `self.deterministic` (False after construction) is toggled by flax's `model.eval()`
/ `model.train()` (Module.set_attributes in flax 0.12.8 sets it on every submodule that has it), and
`nnx.view(model, deterministic=True)` (through `set_view`) gives an eval view without mutating the
model. Only when deterministic is False does a call have side effects: jitter (advancing its RNG
count), the bias update, and the sow. With deterministic=True the layer is a pure function of
(params, bias, x), which `lax.while_loop` decoding needs: a module merged outside a loop cannot be
mutated inside it (flax TraceContextError), so generate with the model in eval mode.

Collecting the metrics (sow into nnx.Intermediate; each call appends one dict to a tuple under "moe"
with keys aux_loss, balance_loss, z_loss, tokens_per_expert (E,), dropped_fraction, router_entropy,
router_probs (E,): P_e):

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest, copy=True)  # copy: the bias is written under grad
        logits = model(batch["x"])
        moe = nnx.pop(model, nnx.Intermediate)                 # removes the sown values from model
        loss = cross_entropy(logits, batch["y"]) + total_aux_loss(moe)
        return loss, (moe, nnx.state(model, nnx.Not(nnx.Param)))   # new rest: the updated bias
    (loss, (moe, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)

inside one jax.jit. Without copy=True, merging inside jax.grad a `rest` built outside it fails with
"Cannot mutate RouterBias from a different trace level". Pop after every training call: a sown value
left on the model becomes part of `rest`, and the next call appends to it (a new structure each
step). flax 0.12.8 warns that sow outside `nnx.capture` is deprecated; `y, moe =
nnx.capture(model, nnx.Intermediate)(x)` returns the same State. Evaluate with `model.eval()` after
the merge (no bias update, no sow).

Departures: the bias is added to whichever score selects (softmax or sigmoid; DeepSeek-V3 uses sigmoid
affinities); DeepSeek-V3's balance loss is per sequence, ours per call (all N tokens); GShard's random
dispatch of second choices is not done; the router weight is N(0, 0.1/D) (Switch's reduced scale, not
truncated); f_e counts all k choices (Switch/GShard count the first choice only); the bias updates once
per forward call (per micro-batch under accumulation); Shazeer et al.'s noisy top-k gating is not
implemented (jitter is the only router noise).
"""

import functools
import math
from typing import Annotated

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from kernels import grouped
from layers.mlp import ACTIVATIONS, GATES, MLP, activate, default_hidden_dim
from layers.options import NonNegFloat, NonNegInt, OneOf, PosFloat, PosInt, Range
from layers.shapes import check_input
from layers.sharding import axes, constrain

ROUTERS = ("topk", "switch", "expert_choice")
SCORE_ORDERS = ("softmax_then_topk", "topk_then_softmax")
SCORINGS = ("softmax", "sigmoid")
DISPATCHES = ("capacity", "dropless")
BALANCES = ("aux_loss", "bias", "none")


class RouterBias(nnx.Variable):
    """Per-expert selection bias of auxiliary-loss-free balancing: non-trainable state, carried and
    checkpointed with the rest of the model's non-Param state, updated in place in training."""


def default_expert_dim(d_model: int, active_experts: int) -> int:
    """The dense MLP's width split over the experts active per token (routed top_k + shared),
    rounded up to a multiple of 8: the same active FFN parameters as the dense MLP."""
    return -(-default_hidden_dim(d_model) // active_experts // 8) * 8


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = min(N, ceil(capacity_factor * N * k / E)): the most assignments one expert keeps."""
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_rows(copies: int, x, order, inverse):
    """The rows of x tiled `copies` times (row j of the tiling is x[j % len(x)]), taken in `order`, a permutation
    of the tiling whose inverse is `inverse`. Its gradient gathers the cotangent by the inverse and adds the copies
    slice by slice, where autodiff scatters (XLA on CPU scatters row by row) and reduces over the copies (a
    reduction XLA gave YNNPACK, at 12 ms a step in benchmarks.peers' MoE)."""
    return x[order % x.shape[0]]


def _take_rows_backward(copies, inverse, g):
    g = g[inverse].reshape(copies, -1, g.shape[-1])
    return sum(g[i] for i in range(copies)), None, None


_take_rows.defvjp(lambda copies, x, order, inverse: (_take_rows(copies, x, order, inverse), inverse),
                  _take_rows_backward)


def _inverse(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def total_aux_loss(intermediates) -> Float[Array, ""]:
    """Sum of every sown "aux_loss" in a State / pytree from nnx.pop or nnx.capture (0 if none)."""
    leaves = jax.tree_util.tree_leaves_with_path(intermediates)
    found = [x for path, x in leaves if path and getattr(path[-1], "key", None) == "aux_loss"]
    return sum(found, jnp.float32(0))


def _choose(name, value, valid):
    if value not in valid:
        raise ValueError(f"MoE: {name}={value!r} is not one of {', '.join(map(repr, valid))}")


class MoE(nnx.Module):
    """Mixture of SwiGLU experts (num_experts, each token to top_k): routers topk (score_order softmax_then_topk or
    topk_then_softmax; renormalize: the top_k gates sum to 1), switch (top-1), expert_choice (not causal; outside
    training it routes by token choice); dispatch, in training: capacity (drops overflow beyond capacity_factor, GShard
    order) or dropless (ragged_dot), and always dropless outside training (evaluation, decoding); balance aux_loss
    (Switch loss, balance_loss_weight), bias (DeepSeek-V3, loss-free, bias_update_rate) or none; z_loss_weight: the
    router z-loss; router_jitter: multiplicative noise on the router's input in training; shared experts
    (num_shared_experts, DeepSeekMoE; shared_hidden_dim: their own width, None = num_shared_experts x hidden_dim;
    shared_gate: a sigmoid gate on them per token, Qwen2-MoE); scoring: softmax or sigmoid (DeepSeek-V3) router scores;
    num_groups, top_groups: each token chooses among the experts of its top_groups best of num_groups expert groups
    (DeepSeek-V3; None = all); routed_scale: a factor on the routed experts' sum; activation: the experts' (routed
    and shared) MLP form, swiglu, geglu or relu2 (no w_gate: Nemotron-H's). hidden_dim None = the dense width /
    active experts (same active params); dtype: the compute dtype (parameters stay float32)."""

    def __init__(self, d_model: int, *, num_experts: PosInt = 8, top_k: PosInt = 2, hidden_dim: PosInt | None = None,
                 router: Annotated[str, OneOf("topk", "switch", "expert_choice")] = "topk",
                 score_order: Annotated[str, OneOf("softmax_then_topk", "topk_then_softmax")] = "softmax_then_topk",
                 renormalize: bool = True, dispatch: Annotated[str, OneOf("capacity", "dropless")] = "capacity",
                 capacity_factor: PosFloat = 1.25, num_shared_experts: NonNegInt = 0,
                 balance: Annotated[str, OneOf("aux_loss", "bias", "none")] = "aux_loss",
                 balance_loss_weight: NonNegFloat = 0.01, z_loss_weight: NonNegFloat = 0.001,
                 bias_update_rate: NonNegFloat = 0.001,
                 router_jitter: Annotated[float, Range(0, 1, hi_open=True)] = 0.0,
                 shared_hidden_dim: PosInt | None = None, shared_gate: bool = False,
                 scoring: Annotated[str, OneOf("softmax", "sigmoid")] = "softmax", num_groups: PosInt = 1,
                 top_groups: PosInt | None = None, routed_scale: PosFloat = 1.0,
                 activation: Annotated[str, OneOf(*ACTIVATIONS)] = "swiglu", dtype=jnp.float32, rngs: nnx.Rngs):
        for name, value, valid in (("router", router, ROUTERS), ("score_order", score_order, SCORE_ORDERS),
                                   ("dispatch", dispatch, DISPATCHES), ("balance", balance, BALANCES),
                                   ("scoring", scoring, SCORINGS), ("activation", activation, ACTIVATIONS)):
            _choose(name, value, valid)
        if num_experts < 1:
            raise ValueError(f"MoE: num_experts={num_experts} must be >= 1" + (
                f"; num_shared_experts={num_shared_experts} always-on experts alone are a dense MLP "
                "(ffn kind 'mlp')" if num_shared_experts > 0 else ""))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        if router == "switch" and top_k != 1:
            raise ValueError(f"MoE: router='switch' routes each token to one expert; set top_k=1 (got {top_k})")
        if router == "topk" and top_k == 1 and (renormalize or score_order == "topk_then_softmax"):
            raise ValueError("MoE: router='topk' with top_k=1 and gates that sum to 1 makes every gate 1, "
                             "so the router gets no gradient; use router='switch' or renormalize=False")
        if router == "expert_choice" and balance == "bias":
            raise ValueError("MoE: balance='bias' does nothing with router='expert_choice' (every expert "
                             "takes exactly C tokens); use balance='aux_loss' or 'none'")
        if capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be > 0")
        if num_shared_experts < 0:
            raise ValueError(f"MoE: num_shared_experts={num_shared_experts} must be >= 0")
        if hidden_dim is not None and hidden_dim < 1 or shared_hidden_dim is not None and shared_hidden_dim < 1:
            raise ValueError(f"MoE: hidden_dim={hidden_dim} and shared_hidden_dim={shared_hidden_dim} must be >= 1 "
                             "or None")
        if (shared_hidden_dim is not None or shared_gate) and not num_shared_experts:
            raise ValueError("MoE: shared_hidden_dim and shared_gate set the shared experts; set num_shared_experts")
        if min(balance_loss_weight, z_loss_weight, bias_update_rate) < 0:
            raise ValueError("MoE: balance_loss_weight, z_loss_weight and bias_update_rate must be >= 0")
        if not 0 <= router_jitter < 1:
            raise ValueError(f"MoE: router_jitter={router_jitter} must be in [0, 1)")
        if scoring == "sigmoid" and router == "topk" and score_order == "topk_then_softmax":
            raise ValueError("MoE: score_order='topk_then_softmax' is a softmax over the chosen logits; sigmoid "
                             "scoring chooses on its scores (score_order='softmax_then_topk')")
        top_groups = num_groups if top_groups is None else top_groups
        if num_groups < 1 or num_experts % num_groups or not 1 <= top_groups <= num_groups:
            raise ValueError(f"MoE: num_groups={num_groups} must divide num_experts={num_experts}, and top_groups="
                             f"{top_groups} must be between 1 and num_groups")
        if top_k > top_groups * (num_experts // num_groups) or num_groups > 1 and router == "expert_choice":
            raise ValueError(f"MoE: num_groups={num_groups} limits each token's top_k={top_k} experts to its "
                             f"top_groups={top_groups} groups of {num_experts // num_groups} (token choice only)")
        if routed_scale <= 0:
            raise ValueError(f"MoE: routed_scale={routed_scale} must be > 0")
        E, F = num_experts, hidden_dim or default_expert_dim(d_model, top_k + num_shared_experts)
        self.num_experts, self.top_k, self.hidden_dim = E, top_k, F
        self.router, self.score_order, self.renormalize, self.dispatch = router, score_order, renormalize, dispatch
        self.capacity_factor, self.num_shared_experts, self.balance = capacity_factor, num_shared_experts, balance
        self.balance_loss_weight, self.z_loss_weight = balance_loss_weight, z_loss_weight
        self.bias_update_rate, self.router_jitter, self.dtype = bias_update_rate, router_jitter, dtype
        self.scoring, self.num_groups, self.top_groups = scoring, num_groups, top_groups
        self.routed_scale, self.activation = routed_scale, activation
        self.deterministic = False
        into, out = axes("expert", "embed", "mlp"), axes("expert", "mlp", "embed")
        self.w_router = nnx.Param(nnx.initializers.normal((0.1 / d_model) ** 0.5)(rngs.params(), (d_model, E)),
                                  **axes("embed", None))
        self.w_gate = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (E, d_model, F)), **into) \
            if activation in GATES else None
        self.w_up = nnx.Param(nnx.initializers.normal(d_model ** -0.5)(rngs.params(), (E, d_model, F)), **into)
        self.w_down = nnx.Param(nnx.initializers.normal(F ** -0.5)(rngs.params(), (E, F, d_model)), **out)
        self.bias = RouterBias(jnp.zeros((E,), jnp.float32))
        if num_shared_experts:
            self.shared = MLP(d_model, hidden_dim=shared_hidden_dim or num_shared_experts * F, activation=activation,
                              dtype=dtype, rngs=rngs)
        self.w_shared_gate = nnx.Param(jnp.zeros((d_model, 1), jnp.float32), **axes("embed", None)) \
            if shared_gate else None
        if router_jitter > 0:
            self.jitter_rngs = rngs["jitter"].fork()

    def set_view(self, deterministic: bool | None = None):
        """Lets `nnx.view(model, deterministic=...)` make a train/eval view without mutating model."""
        if deterministic is not None:
            self.deterministic = deterministic

    def _weights(self):
        """(w_gate or None, w_up, w_down) in the compute dtype."""
        return tuple(None if w is None else w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))

    def _hidden(self, spec, x, wg, wu):
        """The experts' hidden activations, their products by the einsum `spec`."""
        return activate(self.activation, jnp.einsum(spec, x, wu), None if wg is None else jnp.einsum(spec, x, wg))

    def _experts_batched(self, xb):
        """Every expert on its own buffer: (E, C, D) -> (E, C, D). On a mesh the buffers are split
        over the `expert` axis, beside their experts' weights (no-op on one device)."""
        wg, wu, wd = self._weights()
        xb = constrain(xb, ("expert", None, None))
        h = self._hidden("ECD,EDF->ECF", xb, wg, wu)
        return constrain(jnp.einsum("ECF,EFD->ECD", h, wd), ("expert", None, None))

    def _experts_grouped(self, xs, expert, group_sizes):
        """Rows sorted by expert (expert[i] the expert of row i, group_sizes[e] rows for expert e):
        (M, D) -> (M, D): on CPU the grouped products of kernels/grouped (each group times its expert's weights,
        nothing padded); elsewhere each group padded to whole tiles, each tile times its expert's weights."""
        wg, wu, wd = self._weights()
        if grouped.supports(xs, wu):
            hidden = activate(self.activation, grouped.grouped_matmul(xs, wu, group_sizes),
                              None if wg is None else grouped.grouped_matmul(xs, wg, group_sizes))
            return grouped.grouped_matmul(hidden, wd, group_sizes)
        (M, D), E = xs.shape, self.num_experts
        tile = min(64, 1 << max(0, math.ceil(math.log2(max(1, -(-M // E))))))  # ~ the mean group, at most 64
        n_tiles = -(-M // tile) + E  # the sum of ceil(size / tile) over the groups is at most this
        tiles = -(-group_sizes // tile)  # (E,)
        tile_end = jnp.cumsum(tiles)
        starts = jnp.cumsum(group_sizes) - group_sizes
        dest = (tile_end - tiles)[expert] * tile + jnp.arange(M) - starts[expert]  # (M,) row in the tiled buffer
        tiled = jnp.zeros((n_tiles * tile, D), xs.dtype).at[dest].set(xs).reshape(n_tiles, tile, D)
        owner = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), E - 1)  # (n_tiles,)
        wg, wu, wd = (None if w is None else w[owner] for w in (wg, wu, wd))  # (n_tiles, D, F) ...
        h = self._hidden("tmd,tdf->tmf", tiled, wg, wu)
        return jnp.einsum("tmf,tfd->tmd", h, wd).reshape(n_tiles * tile, D)[dest]

    def _grouped_by(self, order, xf, queue, group_sizes):
        """The assignments (k*N, D) through `_experts_grouped`, sorted into groups by `order` and back."""
        k, inverse = queue.shape[0] // xf.shape[0], _inverse(order)
        ys = self._experts_grouped(_take_rows(k, xf, order, inverse), queue[order], group_sizes)
        return _take_rows(1, ys, inverse, order)

    def _token_choice(self, logits, scores, k, order, renormalize):
        """Experts (N, k) int32 and gates (N, k) float32 of each token."""
        select = logits if order == "topk_then_softmax" else scores
        if self.balance == "bias":
            select = select + self.bias[...]  # selection only: the gates below never see the bias
        if self.num_groups > 1:
            select = self._in_top_groups(select)
        _, experts = jax.lax.top_k(select, k)  # (N, k)
        if order == "topk_then_softmax":
            return experts, jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)
        gates = jnp.take_along_axis(scores, experts, axis=-1)
        return experts, gates / jnp.sum(gates, -1, keepdims=True) if renormalize else gates

    def _in_top_groups(self, select):
        """The selection scores (N, E) with -inf outside each token's top_groups groups (DeepSeek-V3's
        group score: the sum of a group's two best scores)."""
        N, E, G = *select.shape, self.num_groups
        grouped = select.reshape(N, G, E // G)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // G))[0], axis=-1)  # (N, G)
        _, best = jax.lax.top_k(group_score, self.top_groups)  # (N, top_groups)
        keep = jnp.zeros((N, G), bool).at[jnp.arange(N)[:, None], best].set(True)
        return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)

    def _dispatch(self, xf, experts, gates, dropless):
        """Token-choice dispatch and combine; returns y (N, D) float32, load (E,), dropped fraction."""
        (N, D), k, E = xf.shape, experts.shape[1], self.num_experts
        queue = experts.T.reshape(-1)  # (k*N,) choice-major: all first choices by position, then seconds
        perm = jnp.argsort(queue, stable=True)  # queue order kept inside each expert
        load = jnp.bincount(queue, length=E)  # (E,)
        if dropless:
            y_assign, kept = self._grouped_by(perm, xf, queue, load), jnp.ones((k * N,), bool)
        else:
            C = expert_capacity(N, E, k, self.capacity_factor)
            starts = jnp.cumsum(load) - load
            rank = jnp.zeros_like(queue).at[perm].set(jnp.arange(k * N) - starts[queue[perm]])  # place in queue
            kept = rank < C
            if grouped.supports(xf, self._weights()[1]):  # the kept assignments alone, grouped by expert (the
                # dropped ones last, past the groups' total, where the products give 0): k*N rows, not E*C
                order = jnp.argsort(jnp.where(kept, queue, E), stable=True)
                y_assign = self._grouped_by(order, xf, queue, jnp.minimum(load, C))
            else:
                token = jnp.tile(jnp.arange(N), k)  # (k*N,)
                slot = jnp.where(kept, queue * C + rank, E * C)  # E*C is out of range: dropped
                buf = jnp.zeros((E * C, D), xf.dtype).at[slot].set(xf[token], mode="drop")  # (E*C, D)
                out = self._experts_batched(buf.reshape(E, C, D)).reshape(E * C, D)
                y_assign = out.at[slot].get(mode="fill", fill_value=0)  # (k*N, D)
        w = gates.T.reshape(-1) * kept  # (k*N,) a dropped assignment has weight 0
        w, y_assign = w.reshape(k, N, 1), y_assign.astype(jnp.float32).reshape(k, N, D)
        y = sum(w[i] * y_assign[i] for i in range(k))  # slice by slice: XLA gave a reduction over k to YNNPACK (slow)
        return y, load.astype(jnp.float32), 1.0 - jnp.mean(kept.astype(jnp.float32))

    def _expert_choice(self, xf, scores):
        """Each expert takes its top-C tokens of all N; returns y (N, D) float32, load, dropped."""
        N, D = xf.shape
        C = expert_capacity(N, self.num_experts, self.top_k, self.capacity_factor)
        g, idx = jax.lax.top_k(scores.T, C)  # (E, C) gates and token indices
        out = self._experts_batched(xf[idx]).astype(jnp.float32)  # (E, C, D)
        y = jnp.zeros((N, D), jnp.float32).at[idx.reshape(-1)].add((g[..., None] * out).reshape(-1, D))
        picked = jnp.zeros((N,), bool).at[idx.reshape(-1)].set(True)
        load = jnp.full((self.num_experts,), C, jnp.float32)
        return y, load, 1.0 - jnp.mean(picked.astype(jnp.float32))  # dropped: tokens no expert took

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        check_input(x, self.w_router.shape[0], None, "MoE")
        B, T, D = x.shape
        xr = x.reshape(B * T, D).astype(jnp.float32)  # (N, D) the router's input, float32
        xf = xr.astype(self.dtype)  # the experts' input
        x_gate = xr  # the shared-expert gate's input: never the jittered one
        if self.router_jitter > 0 and not self.deterministic:
            eps = self.router_jitter
            xr = xr * jax.random.uniform(self.jitter_rngs(), xr.shape, jnp.float32, 1 - eps, 1 + eps)
        logits = xr @ self.w_router[...]  # (N, E) float32
        scores = (jax.nn.softmax if self.scoring == "softmax" else jax.nn.sigmoid)(logits)
        if self.router == "expert_choice" and not self.deterministic and T > 1:
            y, load, dropped = self._expert_choice(xf, scores)
        else:
            topk = self.router == "topk"
            k = self.top_k if self.router != "switch" else 1
            order = self.score_order if topk else "softmax_then_topk"
            experts, gates = self._token_choice(logits, scores, k, order, self.renormalize and topk)
            dropless = self.dispatch == "dropless" or self.deterministic or T == 1
            y, load, dropped = self._dispatch(xf, experts, gates, dropless)
        if self.routed_scale != 1:
            y = y * self.routed_scale
        y = y.reshape(B, T, D).astype(self.dtype)
        if self.num_shared_experts:
            shared = self.shared(x)
            if self.w_shared_gate is not None:  # Qwen2-MoE: sigmoid(x w) scales the shared experts per token
                shared = shared * jax.nn.sigmoid(x_gate @ self.w_shared_gate[...]).reshape(B, T, 1).astype(shared.dtype)
            y = y + shared
        if not self.deterministic:
            self._record(logits, scores, load, dropped)
        return y

    def _record(self, logits, scores, load, dropped):
        """Training-only side effects: the sown losses/metrics and the balancing-bias update."""
        E = self.num_experts
        load = jax.lax.stop_gradient(load)
        probs = scores if self.scoring == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)  # sum 1
        balance_loss = E * jnp.sum(load / jnp.sum(load) * jnp.mean(probs, axis=0))
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        aux = self.z_loss_weight * z_loss
        if self.balance == "aux_loss":
            aux = aux + self.balance_loss_weight * balance_loss
        log_p = jax.nn.log_softmax(logits, axis=-1) if self.scoring == "softmax" else \
            jax.nn.log_sigmoid(logits) - jnp.log(jnp.sum(scores, -1, keepdims=True))
        entropy = -jnp.mean(jnp.sum(probs * log_p, axis=-1))
        self.sow(nnx.Intermediate, "moe", {
            "aux_loss": aux, "balance_loss": balance_loss, "z_loss": z_loss, "tokens_per_expert": load,
            "dropped_fraction": jax.lax.stop_gradient(dropped), "router_entropy": jax.lax.stop_gradient(entropy),
            "router_probs": jax.lax.stop_gradient(jnp.mean(probs, axis=0))})
        if self.balance == "bias":
            self.bias[...] = self.bias[...] + self.bias_update_rate * jnp.sign(jnp.mean(load) - load)
