"""AdamW (Loshchilov & Hutter, 2019) with linear warmup then cosine/linear decay, global-norm
clipping, and no weight decay on norms, biases and embeddings. Updates with a non-finite gradient
are dropped (optax.apply_if_finite); the loop decides whether to stop or go on."""

import jax
import optax

from train.distill import converted_layers
from train.lora import trainable
from zoo.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    floor = t.lr * t.min_lr_ratio
    decay_steps = max(t.steps - t.warmup_steps, 1)
    if t.schedule == "cosine":
        decay = optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.min_lr_ratio)
    elif t.schedule == "linear":
        decay = optax.linear_schedule(t.lr, floor, decay_steps)
    else:
        decay = optax.constant_schedule(t.lr)
    warmup = optax.linear_schedule(t.lr / max(t.warmup_steps, 1), t.lr, max(t.warmup_steps - 1, 0))
    return optax.join_schedules([warmup, decay], [t.warmup_steps])


NO_DECAY = ("embed", "A_log")  # the embedding table; an SSM's decay rates (Mamba's A_log is a matrix)


def decays(params):
    """True for the weights that get weight decay: matrices, except the embedding table and A_log.
    Norm weights, biases, dt_bias, D and other vectors are never decayed."""
    def rule(path, x):
        return x.ndim >= 2 and not any(name in jax.tree_util.keystr(path) for name in NO_DECAY)
    return jax.tree_util.tree_map_with_path(rule, params)


def optimizer(t: TrainConfig, num_layers: int | None = None) -> optax.GradientTransformation:
    """AdamW as the module docstring says; with train.lora only the adapters are updated, with
    train.distill.trainable=converted (a model of `num_layers` layers) only the converted layers'
    mixers; every other parameter's update is zero."""
    adamw = optax.adamw(schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decays)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    if t.lora is not None:  # the adapters' a and b
        label = lambda params: jax.tree.map(lambda m: "train" if m else "frozen", trainable(params))
    elif t.distill is not None and t.distill.trainable == "converted":
        prefixes = tuple(f"['blocks'][{i}]['mixer']" for i in converted_layers(t.distill, num_layers))
        label = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "train" if jax.tree_util.keystr(path).startswith(prefixes) else "frozen", params)
    else:
        label = None
    if label is not None:
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, label)
    return optax.apply_if_finite(tx, max_consecutive_errors=2 ** 30)
