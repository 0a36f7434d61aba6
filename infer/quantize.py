"""Quantized decoding: a copy of a trained LanguageModel whose matrix weights are int8 or int4 codes
with scales (layers/quant.py), and whose attention layers keep an int8 KV cache.

    qmodel = infer.quantize(model, weights="int8", kv_cache="int8")   # model itself is untouched
    new_ids = infer.generate(qmodel, prompts, max_new_tokens=200)
    qmodel = infer.quantize(model, "int4", calibration=tokens)         # GPTQ (layers/gptq.py) on token ids
    qmodel = infer.quantize(model, "int4", calibration=tokens, method="awq")  # or "smoothquant" (W8A8)

What is quantized, per output channel (int8) or per group of `group_size` input rows (int4):
attention's wq, wk, wv, wo; the SwiGLU MLP's w_gate, w_up, w_down; every `layers.Linear` kernel (the
projections of the linear-attention, RetNet, GLA, DeltaNet and Mamba families); RWKV-6's and RWKV-7's
receptance, key, value, gate and output matrices and their channel mixes' matrices; MoE expert weights
(each expert its own scales; read dequantized, their einsums are not `project`); the LM head, the
exit heads, and a tied embedding table (scaled per row, which is per output column of the head it
also is; the lookup dequantizes it). What stays float32: norms, biases, gates and other vectors,
convolution kernels, the MoE router, SSM parameters (A_log), RWKV's low-rank data-dependent
matrices (decay, in-context rate, value residual, gate and token-mix LoRAs), MAD's pooled decoder
head, an untied embedding table (read one row per token, so quantizing it would save memory only), and
every recurrent state.

`activations` picks the product (layers/quant.py): "int8" multiplies by per-token int8 activations
in an int8 x int8 -> int32 dot (W8A8; int4 weights requantized to int8 for it, once per decode call),
the faster form on CPU (benchmarks/quantize_forms.py); "float" dequantizes the weight (exact
activations), which XLA does once per decode call, so it decodes at float speed on a float copy.
The first call compiles the quantizer for each weight shape (1.5 s for the d_model 512, 4-layer
model on 2 busy CPU cores); later calls take 0.02 to 0.15 s, so `generate(quantization=...)` simply
quantizes on every call, and a caller decoding many times may quantize once and pass the copy.
A quantized model decodes and runs forward passes; it is not for training or checkpoints, and its
parameters carry no sharding axes (one device).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.attention import Attention
from layers.gptq import Recorded, gptq_quantize, recording
from layers.linear import Linear
from layers.mlp import MLP
from layers.moe import MoE
from layers.quant import Int8Rows, Quantized, quantize_weight, straight_through
from layers.rwkv6 import RWKV6ChannelMix, RWKV6TimeMix
from layers.rwkv7 import RWKV7TimeMix
from layers.smooth import awq_scales, scaled, smoothquant_scales
from layers.token_shift import RWKVChannelMix
from zoo import checkpoint
from zoo.model import LanguageModel

WEIGHTS = ("int8", "int4")
KV_CACHES = ("int8",)
ACTIVATIONS = ("int8", "float")
METHODS = ("rtn", "gptq", "awq", "smoothquant")

# module type, its parameters, contraction axes, stacked leading axes, read through `project` (lazy)
RULES = (
    (Attention, ("wq", "wk", "wv"), 1, 0, True),
    (Attention, ("wo",), 2, 0, True),  # (H, K, D): contracted over heads and head dim
    (MLP, ("w_gate", "w_up", "w_down"), 1, 0, True),
    (Linear, ("kernel",), 1, 0, True),
    (RWKV6TimeMix, ("w_r", "w_k", "w_v", "w_g", "w_o"), 1, 0, True),
    (RWKV7TimeMix, ("w_r", "w_k", "w_v", "w_o"), 1, 0, True),
    (RWKVChannelMix, ("w_k", "w_v"), 1, 0, True),
    (RWKV6ChannelMix, ("w_r",), 1, 0, True),  # its receptance gate
    (MoE, ("w_gate", "w_up", "w_down"), 1, 1, False),  # (E, D, F): one matrix per expert
)


def quantize(model: LanguageModel, weights: str | None = "int8", kv_cache: str | None = None, *,
             group_size: int = 32, activations: str = "int8", calibration=None, method: str | None = None,
             act_order: bool = False, head: str | None = None) -> LanguageModel:
    """A quantized copy of `model`: weights "int8", "int4", "int3" or None (float), kv_cache "int8" or None.
    int4 (and int3, stored as int4) groups `group_size` consecutive input rows per scale, and that must
    divide every quantized weight's input width: the default 32 divides the SwiGLU width
    (`default_hidden_dim` rounds to a multiple of 32: 1376 = 43 * 32 for d_model 512, which 64 and 128
    do not divide). `method` (default "gptq" with calibration, else "rtn"): "rtn" rounds to nearest;
    the others read `calibration` (token ids (B, T) the model reads, one forward pass of the float model)
    and treat every weight read through `project` (attention's, the MLP's and every Linear kernel):
    "gptq" corrects it on the Hessian of its inputs (layers/gptq.py; `act_order` its order of rows),
    "awq" scales its input channels by the searched activation-aware s (layers/smooth.py) before
    rounding, "smoothquant" (weights and activations int8) moves its inputs' outlier channels into it.
    The head and MoE experts stay rounded to nearest (int4 for int3). `head` ("int8" or "float"; None: as
    the weights) keeps the LM head, the exit heads and a tied embedding table at int8 per column or float
    while the rest takes `weights`: at int4 the tied head carries up to half the loss rounding costs
    (docs/figures.md)."""
    method = method or ("rtn" if calibration is None else "gptq")
    if method not in METHODS:
        raise ValueError(f"quantize: method={method!r}; expected one of {METHODS}")
    if weights not in (None, *WEIGHTS, "int3"):
        raise ValueError(f"quantize: weights={weights!r}; expected one of {(*WEIGHTS, 'int3')} or None")
    if weights == "int3" and method != "gptq":
        raise ValueError("quantize: weights='int3' is GPTQ's: pass calibration (token ids the model reads) and "
                         "method='gptq'")
    if (method == "rtn") != (calibration is None):
        raise ValueError(f"quantize: method={method!r} " + ("reads no calibration" if method == "rtn" else
                                                            "reads calibration: pass token ids the model reads"))
    if method == "smoothquant" and (weights, activations) != ("int8", "int8"):
        raise ValueError(f"quantize: method='smoothquant' is W8A8: weights='int8' and activations='int8', not "
                         f"{weights!r} and {activations!r}")
    if head not in (None, "int8", "float"):
        raise ValueError(f"quantize: head={head!r}; expected 'int8', 'float' or None (as the weights)")
    if kv_cache not in (None, *KV_CACHES):
        raise ValueError(f"quantize: kv_cache={kv_cache!r}; expected one of {KV_CACHES} or None")
    if activations not in ACTIVATIONS:
        raise ValueError(f"quantize: activations={activations!r}; expected one of {ACTIVATIONS}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"quantize: group_size={group_size!r}; expected an even integer >= 2")
    model = nnx.clone(model)
    modules = [m for _, m in nnx.iter_modules(model)]
    if kv_cache is not None:
        attention = [m for m in modules if isinstance(m, Attention)]
        if not attention:
            raise ValueError(f"quantize: kv_cache={kv_cache!r} needs attention layers (a KV cache); this model has "
                             "none (recurrent states stay float32)")
        for m in attention:
            m.kv_cache = kv_cache
    if weights is None:
        return model
    todo = [t for t in matrices(model) if head != "float" or not is_head(model, t)]
    group = None if weights == "int8" else group_size
    if group:
        _check_groups(model, [t for t in todo if head is None or not is_head(model, t)], group)
    stats = {} if calibration is None else input_statistics(model, todo, calibration)
    bits = "int8" if weights == "int8" else "int4"
    for i, (m, name, in_ndim, lead, lazy, transposed) in enumerate(todo):
        w = getattr(m, name).get_value()
        got, w2 = stats.get(i), w.reshape(math.prod(w.shape[:in_ndim]), -1)  # w2: a projection's (In, Out)
        if head == "int8" and is_head(model, todo[i]):
            q = quantize_weight(w, "int8", in_ndim=in_ndim, lead=lead, transposed=transposed, lazy=lazy,
                                dot=activations)
        elif got is None:
            q = quantize_weight(w, bits, in_ndim=in_ndim, lead=lead, group_size=group, transposed=transposed,
                                lazy=lazy, dot=activations)
        elif method == "gptq":
            codes, scale = gptq_quantize(w2, jnp.asarray(got["xtx"]), weights, group_size=group, act_order=act_order)
            q = Quantized(values=codes, scale=scale, shape=tuple(w.shape), dtype=w.dtype, lazy=lazy, dot=activations)
        else:
            s = (awq_scales(w2, jnp.asarray(got["xtx"]), jnp.asarray(got["abssum"] / got["rows"]), bits, group)
                 if method == "awq" else smoothquant_scales(w2, jnp.asarray(got["absmax"])))
            q = scaled(w, s, in_ndim, lambda base: quantize_weight(base, bits, group_size=group, dot=activations))
        setattr(m, name, nnx.Param(q))
    return model


def quantized_like(model: LanguageModel, spec: dict) -> LanguageModel:
    """`model` in the form `quantize` gives it under `spec` (weights, method, group_size, activations,
    kv_cache, head: train/compress.py's record), with any values: the structure a quantized run's checkpoint is
    read into (registered with zoo.checkpoint below). AWQ and SmoothQuant hold scaled weights, so their
    structure comes from one pass over a token-0 window."""
    weights = "int4" if spec["weights"] == "int3" else spec["weights"]  # int3 codes are held as int4
    scaled = spec["method"] in ("awq", "smoothquant")
    return quantize(model, weights, spec["kv_cache"], group_size=spec["group_size"], activations=spec["activations"],
                    method=spec["method"] if scaled else "rtn", head=spec.get("head"),
                    calibration=np.zeros((1, 8), np.int32) if scaled else None)


checkpoint.register_quantized_form(quantized_like)


def fake_quantize(model: LanguageModel, weights: str, *, group_size: int = 32, activations: str = "int8",
                  who: str = "train.qat") -> LanguageModel:
    """Quantization-aware training's forward (train.qat): `model` itself (a copy merged inside a training
    step) with every weight `quantize(model, weights, group_size=group_size, activations=activations)`
    rounds to nearest read as that rounding reads it (int4 read by an int8 product: its int8
    requantization), and with activations="int8" each input of a projection rounded per token as
    the W8A8 product rounds it, both straight through (layers/quant.straight_through): the function is
    the quantized model's and the gradient reaches the float weights. A model's own exit heads (stacked,
    one per exit) are refused with activations="int8"."""
    if weights not in WEIGHTS or activations not in ACTIVATIONS:
        raise ValueError(f"{who}: weights={weights!r}, activations={activations!r}; expected weights in {WEIGHTS} and "
                         f"activations in {ACTIVATIONS}")
    todo = matrices(model)
    group = None if weights == "int8" else group_size
    if group:
        _check_groups(model, todo, group, who)
    for m, name, in_ndim, lead, lazy, transposed in todo:
        if activations == "int8" and lazy and lead:
            raise ValueError(f"{who}: activations='int8' with exit heads (read as W8A8, one per exit) is not "
                             "followed; use activations: float")
        w = getattr(m, name).get_value()
        rows = activations == "int8" and lazy  # read through `project` in W8A8 (a tied table: as the head)
        q = quantize_weight(jax.lax.stop_gradient(w), weights, in_ndim=in_ndim, lead=lead, group_size=group,
                            transposed=transposed, dot="int8" if rows else "float")
        if rows and weights == "int4" and not transposed:  # a tied table is looked up dequantized
            codes, scale = q.as_int8()
            read = (codes.astype(jnp.float32) * scale).reshape(w.shape).astype(w.dtype)
        else:
            read = q.dequantize()
        fake = straight_through(w, read)
        getattr(m, name).set_value(Int8Rows(fake, q, in_ndim) if rows else fake)
    return model


def matrices(model: LanguageModel) -> list[tuple]:
    """The weights that quantization reads, as (module, parameter name, contraction axes, stacked lead
    axes, lazy, transposed): RULES' (lazy ones read through `project`), then the LM head (or the tied
    embedding table, (V, D): the head's (D, V) transposed) and the exit heads."""
    modules = [m for _, m in nnx.iter_modules(model)]
    todo = [(m, name, *rule[2:], False) for m in modules for rule in RULES if isinstance(m, rule[0])
            for name in rule[1] if getattr(m, name) is not None]  # an MLP without gate (relu2) has no w_gate
    todo.append((model, "head", 1, 0, True, False) if model.head is not None else
                (model.embed, "embedding", 1, 0, True, True))
    if model.exit_layers and model.exit_heads is not None:
        todo.append((model, "exit_heads", 1, 1, True, False))
    return todo


def is_head(model: LanguageModel, entry: tuple) -> bool:
    """Whether an entry of `matrices` is the LM head, the exit heads or the tied embedding table."""
    return entry[0] is model or entry[0] is model.embed


def is_projection(model: LanguageModel, entry: tuple) -> bool:
    """Whether an entry of `matrices` is a projection read through `project` (not a head, not MoE experts)."""
    m, _, _, lead, lazy, transposed = entry
    return lazy and not lead and not transposed and m is not model


def input_statistics(model: LanguageModel, todo: list, tokens, who: str = "quantize") -> dict[int, dict]:
    """The statistics of the inputs of each projection of `todo` (entries of `matrices`), by its index,
    from one forward pass of the float model over `tokens` (B, T): "xtx" (X^T X), "absmax" and "abssum"
    per input channel, "rows" (layers/gptq.Recorded); the weights are put back after it."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{who}: calibration is {tokens.dtype}{list(tokens.shape)}; expected token ids (B, T)")
    kept = []
    for i, (m, name, in_ndim, *_) in enumerate(todo):
        if is_projection(model, todo[i]):
            kept.append((m, name, getattr(m, name)))  # the Param itself, with its metadata
            setattr(m, name, nnx.Param(Recorded(kept[-1][2].get_value(), i, in_ndim)))
    with recording() as stats:
        _evaluate(model, tokens)
        jax.effects_barrier()  # every callback has run
    for m, name, param in kept:
        setattr(m, name, param)
    return stats


_evaluate = nnx.jit(lambda model, tokens: nnx.view(model, deterministic=True)(tokens))  # one compile per model shape


def input_hessians(model: LanguageModel, todo: list, tokens, who: str = "quantize") -> dict[int, np.ndarray]:
    """X^T X of the inputs of each projection of `todo`, by its index (`input_statistics`)."""
    return {i: got["xtx"] for i, got in input_statistics(model, todo, tokens, who).items()}


def _check_groups(model, todo, group_size, who="quantize"):
    """Every int4 weight's input width a multiple of group_size, or a ValueError naming the misfits."""
    paths = {id(m): ".".join(map(str, p)) for p, m in nnx.iter_modules(model)}
    widths = {}
    for m, name, in_ndim, lead, _, transposed in todo:
        shape = getattr(m, name).shape
        widths[f"{paths[id(m)]}.{name}".lstrip(".")] = shape[-1] if transposed else \
            math.prod(shape[lead:lead + in_ndim])
    bad = [f"{k} has {w}" for k, w in widths.items() if w % group_size]
    if bad:
        fits = [g for g in (256, 128, 64, 32, 16, 8) if all(w % g == 0 for w in widths.values())]
        raise ValueError(f"{who}: group_size={group_size} must divide the input width of every int4 weight; "
                         f"{', '.join(bad[:3])}{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}. Group "
                         "sizes that fit this model: "
                         f"{', '.join(map(str, fits)) or 'none of 8 to 256'}")


def _held(model: LanguageModel) -> list:
    """The model's parameters as held: arrays and Quantized weights (each one leaf)."""
    return jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, Quantized))


def weight_bytes(model: LanguageModel) -> int:
    """Bytes of the model's parameters as held (int4 codes at half a byte: layers/quant.py)."""
    return sum(x.nbytes for x in _held(model))


def is_quantized(model: LanguageModel) -> bool:
    """Whether any of the model's weights is held quantized (e.g. a run python -m train.compress quantized)."""
    return any(isinstance(x, Quantized) for x in _held(model))
