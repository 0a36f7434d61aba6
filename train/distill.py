"""Distillation from a teacher through the one loop (`train.distill` in a config):

    train:
      distill: {teacher: runs/transformer, temperature: 2.0, lm_weight: 0.1}

The teacher is any model the zoo loads (a run folder or a Hugging Face model folder: zoo.checkpoint.
load_any), placed on the run's mesh as its own layers shard it, in evaluation mode, never trained. Each
training step runs it on the batch and trains the model on

    loss = lm_weight * CE(y, p_s) + (1 - lm_weight) * t^2 * KL(p_t^(t) || p_s^(t))

per token (Hinton et al. 2015), p^(t) = softmax(logits / t); `distill_kl` in the step's metrics is
the KL at that temperature. Stage `layers` (attention transfer, LoLCATs' first step) trains each
converted mixer alone to give its teacher layer's mixer output from the teacher's residual stream
(`distill_mse`, the rest frozen); stage `logits` then distils the whole student end to end. The
validation loss stays the model's cross-entropy, so a distilled run and a run trained from scratch
compare directly. The student is any config of the teacher's
vocabulary and tokenizer (a smaller model of the same or another kind), or the teacher itself with some
layers converted to another kind and started from its weights (train.distill.convert, train/convert.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from zoo.config import Config, student_model


def kl_per_token(student: Float[Array, "*B V"], teacher: Float[Array, "*B V"], temperature: float = 1.0
                 ) -> Float[Array, "*B"]:
    """KL(p_teacher || p_student) of each position in nats, both distributions softened by `temperature`."""
    t = jax.nn.log_softmax(teacher.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(student.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1)


def load_teacher(cfg: Config, mesh, tokenizer) -> tuple:
    """(graphdef, params, rest) of `cfg.train.distill.teacher` on `mesh`, after checking that it has the
    model's vocabulary and (where both have one) the same tokenizer: a ValueError naming the difference."""
    from zoo.checkpoint import load_any

    path = cfg.train.distill.teacher
    model, tok = load_any(path, mesh=mesh)
    if model.cfg.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"train.distill.teacher: {path} has a vocabulary of {model.cfg.vocab_size} tokens and "
                         f"the model {cfg.model.vocab_size}; a teacher and its student share one vocabulary")
    if model.cfg.head != "lm":
        raise ValueError(f"train.distill.teacher: {path} has model.head={model.cfg.head!r}; a teacher must be a "
                         "language model (head lm)")
    if tok is not None and tokenizer is not None and tok.token_bytes() != tokenizer.token_bytes():
        raise ValueError(f"train.distill.teacher: {path}'s tokenizer is not the run's (data.tokenizer): the same "
                         "ids must mean the same text")
    convert = cfg.train.distill.convert
    if convert is not None and cfg.model != student_model(model.cfg, convert.mixer, convert.layers):
        raise ValueError("train.distill.convert: the model section is not the teacher's with the converted layers; "
                         "read the config with zoo.load_config, which derives it")
    return nnx.split(model, nnx.Param, ...)


def start_from(path: str, cfg: Config, mesh, shardings):
    """The latest parameters of run folder `path` (train.distill.start_from), placed with `shardings`,
    after checking that its model is this run's: a ValueError naming the folder otherwise."""
    from zoo.checkpoint import load_model

    saved, model, step = load_model(path, mesh=mesh)
    if saved.model != cfg.model:
        raise ValueError(f"train.distill.start_from: {path} holds another model than this run's (its model section "
                         "differs); start from a run of the same model, e.g. the layers stage of this conversion")
    params = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda x, s: jax.device_put(jnp.array(x, copy=True), s), params, shardings)


def teacher_targets(graphdef, params, rest, batch: dict, distill):
    """What the student is trained to match on a batch, outside any gradient, the teacher in evaluation
    mode: its logits (stage logits), or for each converted layer (stage layers) the residual stream
    entering it and its mixer's output, as (inputs, outputs), each a tuple over the layers of (B, T, D)."""
    model = nnx.merge(graphdef, params, rest, copy=True)
    seg = batch.get("segment_ids")
    if distill.stage == "logits":
        return jax.lax.stop_gradient(model(batch["x"], segment_ids=seg))
    layers = converted_layers(distill, len(model.blocks))

    def step(i, run, x, rest, carry):
        if i in layers:
            block = model.blocks[i]
            carry = (*carry, (x, block.mixer(block.mixer_norm(x), segment_ids=seg)))
        y, rest = run(x, rest)
        return y, rest, carry

    pairs = model.walk(model.embed_tokens(batch["x"]), segment_ids=seg, step=step, carry=())[2]
    return jax.lax.stop_gradient(tuple(zip(*pairs)))


def converted_layers(distill, num_layers: int) -> tuple[int, ...]:
    layers = distill.convert.layers
    return tuple(range(num_layers)) if layers is None else tuple(layers)


def alignment_loss(model, targets, batch: dict, distill) -> tuple[jax.Array, jax.Array]:
    """(the sum over tokens of each converted layer's mean squared error over the width, summed over the
    layers; its mean per token and layer): each student mixer run on the teacher's residual stream."""
    seg, mask = batch.get("segment_ids"), batch["mask"]
    total = jnp.float32(0)
    for i, x, y in zip(converted_layers(distill, len(model.blocks)), *targets, strict=True):
        block = model.blocks[i]
        err = jnp.mean(jnp.square(block.mixer(block.mixer_norm(x), segment_ids=seg).astype(jnp.float32) - y), axis=-1)
        total = total + jnp.sum(err * mask)
    return total, total / (jnp.sum(mask) * len(targets[0]))
