"""A student made from a teacher: the teacher's model with chosen layers' mixers replaced by another
kind, initialised from the teacher's weights (the first step of LoLCATs, Mamba-in-the-Llama, RADLADS):

    student, mapped = convert(teacher, {"kind": "gated_deltanet", "num_heads": 4}, layers=[1, 3])

Every parameter of the student found in the teacher under the same path and shape is copied (the
embeddings, norms, FFNs or MoE, the head, the layers kept). In a converted layer whose teacher layer is
softmax attention, the new mixer's q_proj, k_proj, v_proj and o_proj kernels are set from the
attention's wq, wk, wv and wo (key and value heads repeated over their query group, as
Mamba-in-the-Llama does for GQA) where the shapes agree. At the kinds' defaults: all four for linear
attention, DeltaNet and KDA; q and k for RetNet and Gated DeltaNet (their values are twice as wide); v
and o for GLA (q and k too with expand_k: 1, its keys being half as wide by default); q and o for
HGRN2; q for Gated DeltaProduct; nothing for the SSMs, RWKV and Hyena, which have no such projections.
Everything else of a converted mixer keeps its fresh initialisation: its gates, decays,
convolutions and norms, and Mamba-2's packed in_proj (Mamba-in-the-Llama's C <- q, B <- k, x <- v
map into it is not built).
`mapped` names, for every student parameter taken from the teacher, the teacher parameter it came from.
Distilling the student from the teacher is train.distill (train/distill.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.config import student_model
from zoo.model import LanguageModel

# a converted mixer's projection <- the teacher attention's weight
ATTENTION_TO_PROJECTIONS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}


def convert(teacher: LanguageModel, mixer: dict, layers=None, *, seed: int = 0) -> tuple[LanguageModel, dict]:
    """(student, mapped): the teacher's model with the mixers of `layers` (None: all) replaced by `mixer`,
    initialised from the teacher (module docstring)."""
    student = LanguageModel(student_model(teacher.cfg, mixer, layers, "convert"), rngs=nnx.Rngs(seed))
    params, mapped = initialise(nnx.state(student, nnx.Param), nnx.state(teacher, nnx.Param))
    nnx.update(student, params)
    return student, mapped


def initialise(params, teacher, shardings=None) -> tuple:
    """(params, mapped): the student's `params` (an nnx.State) with every tensor the teacher's parameters `teacher`
    provide (module docstring), each placed with the student's `shardings` when given."""
    ours = {path: v.get_value() for path, v in nnx.to_flat_state(teacher)}
    flat = dict(nnx.to_flat_state(params))
    where = {p: v.get_value() for p, v in nnx.to_flat_state(shardings)} if shardings is not None else {}
    mapped = {}
    for path, var in flat.items():
        source = path if path in ours else _attention_source(path, ours, flat)
        if source is None:
            continue
        value = ours[source] if source == path else _heads_matrix(ours, source)
        if value.shape != var.get_value().shape:
            continue
        value = jnp.array(value, var.get_value().dtype, copy=True)  # its own buffer: the step donates params
        var.set_value(jax.device_put(value, where[path]) if path in where else value)
        mapped[_name(path)] = _name(source)
    return params, mapped


def _attention_source(path: tuple, ours: dict, flat: dict) -> tuple | None:
    """The teacher attention weight a converted mixer's projection kernel comes from, or None:
    (..., "mixer", "q_proj", "kernel") <- (..., "mixer", "wq") where the teacher's mixer is attention
    and the student's is not."""
    if len(path) < 3 or path[-1] != "kernel" or path[-2] not in ATTENTION_TO_PROJECTIONS:
        return None
    mixer = path[:-2]
    source = (*mixer, ATTENTION_TO_PROJECTIONS[path[-2]])
    return source if source in ours and (*mixer, "wq") not in flat else None


def _heads_matrix(ours: dict, source: tuple) -> jax.Array:
    """A teacher attention weight as the (in, out) matrix of a mixer with one head per query head: wq
    (D, H, K) and wk, wv (D, G, K) with each of the G heads repeated over its H / G query heads, as
    (D, H * K); wo (H, K, D) as (H * K, D)."""
    w = ours[source]
    if source[-1] == "wo":
        return w.reshape(-1, w.shape[-1])
    H = ours[(*source[:-1], "wq")].shape[1]
    return jnp.repeat(w, H // w.shape[1], axis=1).reshape(w.shape[0], -1)


def _name(path: tuple) -> str:
    return ".".join(map(str, path))
