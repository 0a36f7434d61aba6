"""Low-rank adapters on a model's projections (LoRA; the value type is layers/lora.py):

    adapted = add_lora(model, rank=8, alpha=16, targets=r"mixer\\.(wq|wv)$")   # model itself is untouched
    ...fine-tune the adapters: trainable(adapted) marks which parameters move...
    plain = merge_lora(adapted)   # W + (alpha / r) A B folded in: an ordinary model to decode or export

In a run, `train.lora` (zoo/config.py's LoraConfig) does this through the loop: `adapt` adds the
adapters to the starting weights, train/optim.py trains only them, and zoo.checkpoint.load_model folds
them in, so `python -m infer` and zoo.hf.save read the run as any other.

The projections that can carry an adapter are the ones quantization reads through `project`
(infer/quantize.RULES): attention's wq, wk, wv, wo, the MLP's three matrices, every `Linear`
kernel of the other mixers and RWKV's receptance, key, value, gate and output matrices; not the
embeddings, the LM head, norms, MoE experts (stacked), or the vectors and small convolutions of the
recurrent kinds. `targets`, a regular expression, picks among them by dotted path
(`blocks.0.mixer.wq`, `blocks.3.ffn.w_up`, `blocks.1.mixer.q_proj.kernel`), searched anywhere in the
path; None takes them all. An adapted model carries no sharding axes on its adapted weights (one
device), as a quantized one.
"""

import re

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from infer.quantize import RULES
from layers.lora import LowRank, low_rank
from zoo.config import LoraConfig
from zoo.model import LanguageModel


def projections(model: LanguageModel) -> list[tuple[str, nnx.Module, str, int]]:
    """(dotted path, module, parameter name, contraction axes) of every weight that can carry an adapter."""
    out = []
    for path, m in nnx.iter_modules(model):
        for kind, names, in_ndim, lead, _ in RULES:
            if isinstance(m, kind) and not lead:
                out += [(".".join(map(str, (*path, name))), m, name, in_ndim) for name in names]
    return out


def add_lora(model: LanguageModel, rank: int, alpha: float | None = None, targets: str | None = None, *,
             seed: int = 0) -> LanguageModel:
    """A copy of `model` with an adapter of `rank` on each projection whose dotted path matches `targets`
    (module docstring); alpha defaults to rank (scale 1). Its function is the model's until b moves."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"add_lora: rank={rank!r}; expected a positive integer")
    model = nnx.clone(model)
    found = projections(model)
    chosen = [p for p in found if targets is None or re.search(targets, p[0])]
    if not chosen:
        raise ValueError(f"add_lora: targets={targets!r} matches no projection; they are "
                         f"{', '.join(p for p, *_ in found[:8])}{' ...' if len(found) > 8 else ''}")
    key = jax.random.key(seed)
    for i, (path, m, name, in_ndim) in enumerate(chosen):
        base = getattr(m, name).get_value()
        if isinstance(base, LowRank):
            raise ValueError(f"add_lora: {path} already carries an adapter; merge_lora first")
        setattr(m, name, nnx.Param(low_rank(base, rank, rank if alpha is None else alpha, jax.random.fold_in(key, i),
                                            in_ndim=in_ndim)))
    return model


def adapt(graphdef, params, rest, lora: LoraConfig, seed: int, mesh: Mesh) -> tuple:
    """(graphdef, params, their NamedShardings) of the model (graphdef, params, rest) with train.lora's
    adapters (train/loop.py): each base keeps its sharding, the adapters are replicated on `mesh`."""
    model = add_lora(nnx.merge(graphdef, params, rest), lora.rank, lora.alpha, lora.targets, seed=seed)
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.tree.map(lambda x, new: jax.device_put(x, replicated) if new else x, params, trainable(params))
    return graphdef, params, jax.tree.map(lambda x: x.sharding, params)


def merge_lora(model: LanguageModel) -> LanguageModel:
    """A copy of `model` with every adapter folded into its weight: W + (alpha / r) A B."""
    model = nnx.clone(model)
    for _, m, name, _ in projections(model):
        value = getattr(m, name).get_value()
        if isinstance(value, LowRank):
            setattr(m, name, nnx.Param(value.merged()))
    return model


def trainable(params):
    """The mask of a parameter tree (an nnx.State) for fine-tuning adapters only: True at each adapter's a and b, False
    at every other leaf (bases included); for `optax.masked` or to zero the other gradients."""
    is_adapter = lambda x: isinstance(x, LowRank)
    return jax.tree.map(lambda x: jax.tree.unflatten(jax.tree.structure(x), [False, True, True]) if is_adapter(x)
                        else False, params, is_leaf=is_adapter)  # (base, a, b)
