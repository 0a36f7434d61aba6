"""What every architecture module of zoo/hf needs: the conversions between a checkpoint's tensors
and the zoo's parameters, and reading and refusing config.json values.

A tensor table (each family's `tensors`) is a list of rows (zoo parameter path, checkpoint names,
names' arrays -> the zoo array, zoo array -> the arrays); `one`, `same`, `linear` and `conv` make the
last two for a parameter that is one checkpoint tensor. Where checkpoint tensors fuse several zoo
parameters (Qwen3-Next's in_proj_qkvz), a row's path is a list of paths, names' arrays -> one array
per path, and the arrays of the paths (as arguments) -> the checkpoint's.
"""

one = lambda to, back: (lambda a: to(a[0]), lambda w: [back(w)])  # one checkpoint tensor <-> one parameter
same, linear = one(lambda a: a, lambda w: w), one(lambda a: a.T, lambda w: w.T)  # torch Linear: (out, in)
conv = one(lambda a: a[:, 0].T, lambda w: w.T[:, None])  # torch depthwise Conv1d (C, 1, W) <-> (W, C)


def number(v) -> float:
    """A config.json number; transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def refuse(hf: dict, where: str, **bad):
    """A ValueError naming the first config.json field whose value the zoo cannot honour."""
    for key, ok in bad.items():
        if not ok(hf.get(key)):
            raise ValueError(f"{where}: {key}={hf.get(key)!r} is not supported by the zoo's layers")


def outer_rows(cfg, embed: str = "model.embed_tokens.weight", norm: str = "model.norm.weight",
               norm_form: tuple = same) -> list[tuple]:
    """The rows outside the blocks: the embeddings, the final norm's weight (`norm_form`: its conversion,
    e.g. Qwen3-Next's zero-centred one) and, untied, the head."""
    rows = [(("embed", "embedding"), [embed], *same), (("norm", "weight"), [norm], *norm_form)]
    if not cfg.tie_embeddings:
        rows.append((("head",), ["lm_head.weight"], *linear))
    return rows


def fla_model_tensors(cfg) -> list[tuple]:
    """The rows outside the blocks in flash-linear-attention's layout (GLA, RWKV-7): embeddings, final
    norm (with its bias for LayerNorm), head."""
    bias = [(("norm", "bias"), ["model.norm.bias"], *same)] if cfg.norm == "layer" else []
    return outer_rows(cfg, "model.embeddings.weight") + bias
