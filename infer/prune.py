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
"""

import math

from flax import nnx

from infer.quantize import input_hessians, is_projection, matrices
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
