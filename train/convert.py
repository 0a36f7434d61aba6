"""A student made from a teacher: the teacher's model with chosen layers' mixers replaced by another
kind, initialised from the teacher's weights (the first step of LoLCATs, Mamba-in-the-Llama, RADLADS):

    student, mapped = convert(teacher, {"kind": "gated_deltanet", "num_heads": 4}, layers=[1, 3])

Every parameter of the student found in the teacher under the same path and shape is copied (the
embeddings, norms, FFNs or MoE, the head, the layers kept). In a converted layer whose teacher layer is
softmax attention, the new mixer's q_proj, k_proj, v_proj and o_proj kernels are set from the
attention's wq, wk, wv and wo (key and value heads repeated over their query group, as
Mamba-in-the-Llama does for GQA) where the shapes agree, and any mixer's out_proj from wo; a Mamba-2's
in_proj takes its x, B and C columns from wv, wk and wq, as Mamba-in-the-Llama maps them, each where its
width agrees (docs/distillation.md has the table of what each kind takes at its defaults). Everything
else of a converted mixer keeps its fresh initialisation: its gates, decays, convolutions and norms.
`mapped` names, for every student parameter taken from the teacher, the teacher parameter it came from.
Distilling the student from the teacher is train.distill (train/distill.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.config import ModelConfig, student_model
from zoo.model import LanguageModel

# a converted mixer's projection <- the teacher attention's weight
ATTENTION_TO_PROJECTIONS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "out_proj": "wo"}
# and Mamba-2's in_proj columns [z, x, B, C, dt] <- (its own, wv, wk, wq, its own): _mamba2_in_proj


def convert(teacher: LanguageModel, mixer: dict, layers=None, *, seed: int = 0) -> tuple[LanguageModel, dict]:
    """(student, mapped): the teacher's model with the mixers of `layers` (None: all) replaced by `mixer`,
    initialised from the teacher (module docstring)."""
    student = LanguageModel(student_model(teacher.cfg, mixer, layers, "convert"), rngs=nnx.Rngs(seed))
    params, mapped = initialise(nnx.state(student, nnx.Param), nnx.state(teacher, nnx.Param), student.cfg)
    nnx.update(student, params)
    return student, mapped


def initialise(params, teacher, model: ModelConfig, shardings=None) -> tuple:
    """(params, mapped): the student's `params` (an nnx.State of the model config `model`) with every tensor
    the teacher's parameters `teacher` provide (module docstring), each placed with the student's
    `shardings` when given."""
    ours = {path: v.get_value() for path, v in nnx.to_flat_state(teacher)}
    flat = dict(nnx.to_flat_state(params))
    where = {p: v.get_value() for p, v in nnx.to_flat_state(shardings)} if shardings is not None else {}
    mapped = {}
    for path, var in flat.items():
        source = path if path in ours else _attention_source(path, ours, flat)
        if source is None:
            continue
        if source != path and path[-2] == "in_proj":
            value, names = _mamba2_in_proj(var.get_value(), ours, source[:-1], model.mixers()[path[1]], model.d_model)
            if not names:
                continue
            source = (*source[:-1], "+".join(names))
        else:
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
    and the student's is not; a Mamba-2 in_proj <- its teacher's wq (and wk, wv)."""
    if len(path) < 3 or path[-1] != "kernel" or path[-2] not in (*ATTENTION_TO_PROJECTIONS, "in_proj"):
        return None
    mixer = path[:-2]
    source = (*mixer, ATTENTION_TO_PROJECTIONS.get(path[-2], "wq"))
    return source if source in ours and (*mixer, "wq") not in flat else None


def _mamba2_in_proj(kernel, ours: dict, attention: tuple, mixer, d_model: int) -> tuple[jax.Array, list[str]]:
    """A Mamba-2 in_proj kernel (D, [z, x, B, C, dt]) with x <- wv (heads repeated), B <- wk and C <- wq
    where the widths agree (x: expand * D = H K; B: num_groups * state_size = G K, with state_size = K; C:
    num_groups * state_size = H K, so an MHA teacher with num_groups = heads); the other columns as they
    were. Also the names of the teacher weights used."""
    if mixer.KIND != "mamba2":
        return kernel, []
    Di, GN = mixer.expand * d_model, mixer.num_groups * mixer.state_size
    starts = {"wv": Di, "wk": 2 * Di, "wq": 2 * Di + GN}
    widths = {"wv": Di, "wk": GN, "wq": GN}
    used = []
    for name, start in starts.items():
        w = _heads_matrix(ours, (*attention, name)) if name != "wk" else ours[(*attention, name)]
        w = w.reshape(w.shape[0], -1)
        if w.shape[1] == widths[name]:
            kernel = kernel.at[:, start:start + widths[name]].set(w.astype(kernel.dtype))
            used.append(name)
    return kernel, used


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
