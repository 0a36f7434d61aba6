"""What every architecture module of zoo/hf needs: the conversions between a checkpoint's tensors
and the zoo's parameters, and reading and refusing config.json values.

A tensor table (each family's `tensors`) is a list of rows (zoo parameter path, checkpoint names,
names' arrays -> the zoo array, zoo array -> the arrays); `one`, `same`, `linear` and `conv` make the
last two for a parameter that is one checkpoint tensor. Where checkpoint tensors fuse several zoo
parameters (Qwen3-Next's in_proj_qkvz), a row's path is a list of paths, names' arrays -> one array
per path, and the arrays of the paths (as arguments) -> the checkpoint's.

FP8 checkpoints (config.json's quantization_config of quant_method fp8, transformers' fine-grained FP8:
DeepSeek-V3 / V3.1 / R1, Kimi K2, the Qwen3 FP8 releases) store each quantized weight as float8 with a float
`<name>_scale_inv` beside it, one scale per block of weight_block_size (rows, columns) of its last two axes, the
last blocks ragged; `fp8_blocks` reads that config and `dequantize` multiplies a weight back out. What the
config leaves unquantized (modules_to_not_convert, the head, norms, routers) is stored as plain floats.
"""

import numpy as np

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


def fp8_blocks(hf: dict, where: str) -> tuple[int, int] | None:
    """The (rows, columns) of the scale blocks of config.json's FP8 quantization_config, None without one; any
    other quantization, or a setting of this one the zoo cannot honour, a ValueError naming the field. fmt needs
    no check: each tensor's safetensors dtype (F8_E4M3 or F8_E5M2) says it."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    q = {"weight_block_size": [128, 128], **q}  # transformers' default; null would be one scale per tensor
    refuse(q, f"{where}: quantization_config", quant_method=lambda v: v == "fp8",
           weight_block_size=lambda v: isinstance(v, list | tuple) and len(v) == 2
           and all(isinstance(n, int) and n > 0 for n in v),
           activation_scheme=lambda v: v in (None, "dynamic"),  # static: activation_scale tensors, refused
           scale_fmt=lambda v: v in (None, "float", "ue8m0"),  # ue8m0: float scales that are powers of two
           expert_dtype=lambda v: v in (None, "fp8"))  # fp4: packed experts (DeepSeek-V4)
    return tuple(q["weight_block_size"])


def dequantize(q: np.ndarray, scale_inv: np.ndarray, blocks: tuple[int, int], dtype) -> np.ndarray:
    """A float8 weight (..., rows, columns) times the scale_inv (..., ceil(rows / r), ceil(columns / c)) of its
    block of `blocks` (r, c), in float32, as `dtype`; one block row at a time, so that beyond the result only a
    block row of float32 is made."""
    r, c = blocks
    out = np.empty(q.shape, dtype)
    for i in range(scale_inv.shape[-2]):
        rows = slice(i * r, (i + 1) * r)
        s = np.repeat(np.asarray(scale_inv[..., i, None, :], np.float32), c, -1)[..., :q.shape[-1]]  # (..., 1, cols)
        out[..., rows, :] = np.asarray(q[..., rows, :], np.float32) * s
    return out


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
