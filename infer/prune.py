"""Pruned copies of a model (layers/prune.py on each projection): magnitude, Wanda or SparseGPT, to a
sparsity or an n:m pattern, with the Hessians of the projections' inputs from one forward pass of the
float model over calibration token ids (infer/quantize.input_hessians).

    sparse = infer.prune(model, "sparsegpt", sparsity=0.5, calibration=tokens)   # model itself is untouched
    sparse = infer.prune(model, "wanda", n_of_m=(2, 4), calibration=tokens)

What is pruned: every weight read through `project` (attention's wq, wk, wv, wo, the MLP's three matrices,
every `Linear` kernel of the other kinds, RWKV's receptance, key, value, gate and output matrices and its
channel mix's). What is not: the embeddings and heads, MoE experts, norms,
convolutions, and the vectors and small matrices the recurrent kinds read by einsums of their own. The
result is an ordinary float model (the zeros are stored): it decodes, trains and checkpoints as any
other, and a fine-tune moves the zeros unless it masks them.

Structured pruning, `shrink`, removes whole units instead (attention, GLA and Gated DeltaNet heads, SwiGLU
channels, MoE experts, Mamba-2 state channels), the same share in every layer, so the smaller model has a
config of its own:

    small = infer.shrink(model, heads=0.25, channels=0.25, calibration=tokens)   # small.cfg describes it
"""

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.quantize import input_hessians, is_projection, matrices
from layers.attention import Attention
from layers.deltanet import GatedDeltaNet
from layers.gla import GatedLinearAttention
from layers.mamba2 import Mamba2
from layers.mlp import MLP
from layers.moe import MoE
from layers.prune import prune_weight
from zoo.model import LanguageModel


def prune(model: LanguageModel, method: str = "sparsegpt", *, sparsity: float | None = 0.5,
          n_of_m: tuple[int, int] | None = None, calibration=None, block: int = 128) -> LanguageModel:
    """A copy of `model` with each projection pruned by `method` (magnitude, wanda, sparsegpt) to
    `sparsity` (per output column) or to `n_of_m` (n of every m consecutive inputs); wanda and sparsegpt
    read `calibration` (token ids (B, T)); SparseGPT picks its masks a block of gcd(block, In) rows at a
    time. Errors name a bad method, sparsity, pattern or calibration."""
    if method != "magnitude" and calibration is None:
        raise ValueError(f"prune: method={method!r} weighs the inputs: pass calibration (token ids the model reads)")
    if n_of_m is not None:
        sparsity = None
    model = nnx.clone(model)
    todo = [t for t in matrices(model) if is_projection(model, t)]
    hessians = {} if method == "magnitude" else input_hessians(model, todo, calibration, who="prune")
    for i, (m, name, in_ndim, *_) in enumerate(todo):
        param = getattr(m, name)
        w = param.get_value()
        In = math.prod(w.shape[:in_ndim])
        pruned = prune_weight(w.reshape(In, -1), hessians.get(i), method, sparsity=sparsity,
                              n_of_m=None if n_of_m is None else tuple(n_of_m), block=math.gcd(block, In))
        param.set_value(pruned.reshape(w.shape))
    return model


def shrink(model: LanguageModel, *, heads: float = 0.0, channels: float = 0.0, experts: float = 0.0,
           state: float = 0.0, calibration=None) -> LanguageModel:
    """A smaller model (structured pruning): the same share of every layer's heads, SwiGLU channels, MoE
    experts and SSM state channels removed, the least important first, so that its config describes it
    (the returned model's `cfg`) and it trains, decodes, checkpoints and exports as any other. Each share
    is the fraction of a layer's count removed (rounded to whole units; at least one stays).

    What a unit is, per kind (the config key that shrinks):
      heads: softmax attention's query heads (num_heads; MHA removes a query head with its key and
        value head, GQA and MQA the same number of query heads from every key-value group, keeping the
        kv heads), GLA's and Gated DeltaNet's heads (num_heads, and GLA's expand_k and expand_v; a head
        is its (K, V) block of the state, with its q, k, v, gate, decay and output slices: the state
        channels of these kinds come in heads);
      channels: the SwiGLU MLP's hidden channels (ffn.hidden_dim);
      experts: MoE's routed experts (ffn.num_experts; never below top_k);
      state: Mamba-2's state channels (state_size; channel n of each group: the columns of B and C
        that write and read column n of every head's (P, N) state).
    Importance, from `calibration` (token ids (B, T), one forward pass of the float model) when given: a
    head's or channel's expected squared contribution to the layer's output alone (E|o_h W_o^h|^2 from
    the Hessian of the output projection's inputs; E[h_j^2] |w_down[j]|^2 for a channel), an expert's
    mean router probability, a state channel's sqrt(E[b_n^2] E[c_n^2]) (b_n, c_n: B's and C's input
    projections on the calibration inputs); without it the same weights' norms (experts need
    calibration). A unit whose output (or, for a state channel, read) weights are zero has importance 0,
    so removing it leaves the function as it was.

    Refused: attention with per-head masks (head_masks: the config gives every layer the same masks), Gated
    DeltaNet's grouped value heads (num_v_heads), the other kinds' heads (RWKV, the other delta rules, MLA,
    ...), MoE's shared experts and expert widths, a share that no layer of the model has."""
    shares = {"heads": heads, "channels": channels, "experts": experts, "state": state}
    for name, share in shares.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
            raise ValueError(f"shrink: {name}={share!r}; expected the fraction of each layer's {name} to remove, "
                             "in [0, 1)")
    units = [(name, share, i, part) for name, share in shares.items() if share for i, b in enumerate(model.blocks)
             for part in ("mixer", "ffn") if type(getattr(b, part)) in UNITS[name]]
    kinds = sorted({type(getattr(b, part)).__name__ for b in model.blocks for part in ("mixer", "ffn")})
    for name, share in shares.items():
        if share and not any(u[0] == name for u in units):
            raise ValueError(f"shrink: {name}={share} removes {' or '.join(c.__name__ for c in UNITS[name])} {name}; "
                             f"this model's layers are {', '.join(kinds)}")
    if experts and calibration is None:
        raise ValueError("shrink: experts= ranks experts by their router probability: pass calibration (token ids)")
    if heads and any(type(b.mixer) is Attention and any(isinstance(v, tuple) for v in dataclasses.astuple(b.mixer.band))
                     for b in model.blocks):
        raise ValueError("shrink: heads= on attention with per-head masks (head_masks): the config gives every layer "
                         "the same masks, so a layer cannot keep heads of its own")
    stats = {} if calibration is None else _statistics(model, calibration, bool(heads or channels or state),
                                                       bool(experts))
    tree = nnx.to_pure_dict(nnx.state(model))
    mixers, ffns = list(model.cfg.mixers()), list(model.cfg.ffns())
    for name, share, i, part in units:
        module = getattr(model.blocks[i], part)
        picks, changes = UNITS[name][type(module)](module, stats, share)
        for path, (axis, index) in picks.items():  # a path the layer lacks (no conv, no bias) is skipped
            *parents, leaf = path.split(".")
            node = functools.reduce(lambda d, k: d.get(k) or {}, parents, tree["blocks"][i][part])
            if node.get(leaf) is not None:
                node[leaf] = jnp.take(node[leaf], jnp.asarray(index), axis=axis)
        configs = mixers if part == "mixer" else ffns
        configs[i] = dataclasses.replace(configs[i], **changes)
    pattern, ffn_pattern = model.cfg.layer_pattern, model.cfg.ffn_pattern
    cfg = dataclasses.replace(
        model.cfg, **({"layer_pattern": tuple(mixers[:len(pattern)])} if pattern else {"mixer": mixers[0]}),
        **({"ffn_pattern": tuple(ffns[:len(ffn_pattern)])} if ffn_pattern else {"ffn": ffns[0]}))
    small = LanguageModel(cfg, rngs=nnx.Rngs(0))
    target = nnx.state(small)
    nnx.replace_by_pure_dict(target, tree)
    nnx.update(small, target)
    for (_, a), (_, b) in zip(nnx.iter_modules(model), nnx.iter_modules(small), strict=True):
        if hasattr(a, "deterministic"):  # the mode it was in
            b.deterministic = a.deterministic
    return small


def _statistics(model: LanguageModel, calibration, projections: bool, experts: bool) -> dict:
    """From one pass over `calibration`: X^T X of the inputs of the projections that rank heads, channels and
    state channels (attention's wo, the MLP's w_down, Gated DeltaNet's o_proj, Mamba-2's in_proj) by
    (id(module), name) (when `projections`), and each MoE's mean router probabilities (E,) by id(module)
    (when `experts`)."""
    stats = {}
    if projections:
        ranked = {(id(m), name) for b in model.blocks for part in (b.mixer, b.ffn)
                  if type(part) in RANKED_BY for m, name in [RANKED_BY[type(part)](part)]}
        todo = [t for t in matrices(model) if (id(t[0]), t[1]) in ranked]
        stats = {(id(todo[i][0]), todo[i][1]): xtx for i, xtx in input_hessians(model, todo, calibration,
                                                                               who="shrink").items()}
    if experts:  # the MoE layers of a copy in training mode (they sow their metrics there), nothing else
        probe = nnx.clone(model)
        probe.eval()
        for b in probe.blocks:
            if type(b.ffn) is MoE:
                b.ffn.deterministic, b.ffn.router_jitter = False, 0.0
        _, sown = nnx.capture(probe, nnx.Intermediate)(jnp.asarray(calibration))
        sown = nnx.to_pure_dict(sown)["blocks"]
        for i, b in enumerate(model.blocks):
            if type(b.ffn) is MoE:
                stats[id(b.ffn)] = np.asarray(sown[i]["ffn"]["moe"][0]["router_probs"])
    return stats


def _top(scores, share: float, what: str) -> np.ndarray:
    """The indices (ascending) of the round((1 - share) n) largest of n `scores`, at least one."""
    n = len(scores)
    keep = n - round(share * n)
    if keep < 1:
        raise ValueError(f"shrink: {what}={share} would remove all {n} {what} of a layer")
    return np.sort(np.argsort(-np.asarray(scores), kind="stable")[:keep])


def _units(kept, width: int) -> np.ndarray:
    """The indices of units `kept` along an axis of consecutive units of `width` entries each."""
    return (np.asarray(kept)[:, None] * width + np.arange(width)).reshape(-1)


def _array(param) -> np.ndarray:
    return np.asarray(param.get_value(), np.float64)


def _output_scores(w_out, stats: dict, key, width: int, fallback) -> np.ndarray:
    """Each unit's E|o_u W^u|^2 (o_u: the `width` inputs of unit u of the output projection `w_out`,
    its In axis first), from the Hessian of its inputs in `stats` under `key`; else |W^u| times `fallback`."""
    w = _array(w_out)
    w = w.reshape(-1, width, w.shape[-1])  # (units, width, D)
    xtx = stats.get(key)
    if xtx is None:
        return np.linalg.norm(w, axis=(1, 2)) * fallback
    return np.array([np.sum((xtx[u * width:(u + 1) * width, u * width:(u + 1) * width] @ wu) * wu)
                     for u, wu in enumerate(w)])


def _attention_heads(m: Attention, stats: dict, share: float):
    H, G, K = m.num_heads, m.num_kv_heads, m.head_dim
    v = np.linalg.norm(_array(m.wv), axis=(0, 2))  # (G,)
    scores = _output_scores(m.wo, stats, (id(m), "wo"), K, np.repeat(v, H // G))
    if G == H:
        kept = kv = _top(scores, share, "heads")
    else:
        R = H // G
        kept, kv = np.concatenate([g * R + _top(scores[g * R:(g + 1) * R], share, "heads") for g in range(G)]), None
    picks = {"wq": (1, kept), "wo": (0, kept), "bq": (0, kept)}
    if kv is not None:
        picks.update({"wk": (1, kv), "wv": (1, kv), "bk": (0, kv), "bv": (0, kv)})
    return picks, dict(num_heads=len(kept), num_kv_heads=G if kv is None else len(kv), head_dim=K)


def _state_heads(m, stats: dict, share: float, V: int) -> np.ndarray:
    """The heads kept of a GLA or Gated DeltaNet layer `m` (heads of V value channels): ranked by their
    output through o_proj, or by |W_v^h| |W_o^h| without calibration."""
    v = np.linalg.norm(_array(m.v_proj.kernel).reshape(-1, m.num_heads, V), axis=(0, 2))
    return _top(_output_scores(m.o_proj.kernel, stats, (id(m.o_proj), "kernel"), V, v), share, "heads")


def _delta_heads(m: GatedDeltaNet, stats: dict, share: float):
    if m.num_v_heads != m.num_heads:
        raise ValueError(f"shrink: heads= on Gated DeltaNet with grouped value heads (num_v_heads={m.num_v_heads}, "
                         f"num_heads={m.num_heads}: Qwen3-Next's layout) is not supported; a head there is a group")
    K, V = m.head_dim, m.value_dim
    kept = _state_heads(m, stats, share, V)
    k, v = _units(kept, K), _units(kept, V)
    picks = {"q_proj.kernel": (1, k), "k_proj.kernel": (1, k), "v_proj.kernel": (1, v), "g_proj.kernel": (1, v),
             "q_conv.weight": (1, k), "k_conv.weight": (1, k), "v_conv.weight": (1, v), "q_conv.bias": (0, k),
             "k_conv.bias": (0, k), "v_conv.bias": (0, v), "a_proj.kernel": (1, kept), "b_proj.kernel": (1, kept),
             "A_log": (0, kept), "dt_bias": (0, kept), "o_proj.kernel": (0, v)}
    return picks, dict(num_heads=len(kept), head_dim=K)


def _gla_heads(m: GatedLinearAttention, stats: dict, share: float):
    H, D = m.num_heads, m.d_model
    K, V = m.key_dim // H, m.value_dim // H
    kept = _state_heads(m, stats, share, V)
    k, v = _units(kept, K), _units(kept, V)
    if int(D * (len(k) / D)) != len(k) or int(D * (len(v) / D)) != len(v):
        raise ValueError(f"shrink: heads={share} leaves GLA key and value widths {len(k)}, {len(v)} that "
                         f"expand_k and expand_v cannot give at d_model={D}")
    picks = {"q_proj.kernel": (1, k), "k_proj.kernel": (1, k), "v_proj.kernel": (1, v), "g_proj.kernel": (1, v),
             "gk_up.kernel": (1, k), "gk_up.bias": (0, k), "conv_q.weight": (1, k), "conv_k.weight": (1, k),
             "conv_v.weight": (1, v), "o_proj.kernel": (0, v)}
    return picks, dict(num_heads=len(kept), expand_k=len(k) / D, expand_v=len(v) / D)


def _mlp_channels(m: MLP, stats: dict, share: float):
    down = _array(m.w_down)
    xtx = stats.get((id(m), "w_down"))
    norm = lambda w: np.linalg.norm(_array(w), axis=0)
    gate = norm(m.w_up) if m.w_gate is None else norm(m.w_gate)  # relu2 (no gate): h = relu(u.x)^2, the up norm twice
    scores = np.diag(xtx) * (down ** 2).sum(1) if xtx is not None else \
        gate * norm(m.w_up) * np.linalg.norm(down, axis=1)
    kept = _top(scores, share, "channels")
    picks = {"w_gate": (1, kept), "w_up": (1, kept), "w_down": (0, kept), "b_gate": (0, kept), "b_up": (0, kept)}
    return picks, dict(hidden_dim=len(kept))


def _experts(m: MoE, stats: dict, share: float):
    kept = _top(stats[id(m)], share, "experts")
    if len(kept) < m.top_k:
        raise ValueError(f"shrink: experts={share} keeps {len(kept)} of {m.num_experts} experts, fewer than "
                         f"top_k={m.top_k}")
    picks = {name: (0, kept) for name in ("w_gate", "w_up", "w_down", "bias")}
    return {**picks, "w_router": (1, kept)}, dict(num_experts=len(kept))


def _ssm_state(m: Mamba2, stats: dict, share: float):
    Di, G, N = m.d_inner, m.num_groups, m.state_size
    w = _array(m.in_proj.kernel)  # (D, [z, x, B, C, dt])
    b, c = w[:, 2 * Di:2 * Di + G * N], w[:, 2 * Di + G * N:2 * Di + 2 * G * N]  # (D, G N) each
    xtx = stats.get((id(m.in_proj), "kernel"))
    energy = (lambda u: np.sum((xtx @ u) * u, 0)) if xtx is not None else (lambda u: np.sum(u * u, 0))
    scores = np.sqrt(energy(b) * energy(c)).reshape(G, N)
    kept = [_top(scores[g], share, "state channels") for g in range(G)]
    bc = np.concatenate([g * N + k for g, k in enumerate(kept)])  # within B (and C)
    x_end = 2 * Di
    columns = np.concatenate([np.arange(x_end), x_end + bc, x_end + G * N + bc, np.arange(x_end + 2 * G * N,
                                                                                         w.shape[1])])
    conv = columns[Di:Di + Di + 2 * len(bc)] - Di  # the conv's channels: [x, B, C]
    return {"in_proj.kernel": (1, columns), "conv.weight": (1, conv), "conv.bias": (0, conv)}, \
        dict(state_size=len(kept[0]))


UNITS = {"heads": {Attention: _attention_heads, GatedDeltaNet: _delta_heads, GatedLinearAttention: _gla_heads},
         "channels": {MLP: _mlp_channels}, "experts": {MoE: _experts}, "state": {Mamba2: _ssm_state}}
RANKED_BY = {Attention: lambda m: (m, "wo"), GatedDeltaNet: lambda m: (m.o_proj, "kernel"),  # (module, weight)
             GatedLinearAttention: lambda m: (m.o_proj, "kernel"),
             MLP: lambda m: (m, "w_down"), Mamba2: lambda m: (m.in_proj, "kernel")}
