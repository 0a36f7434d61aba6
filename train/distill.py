"""Distillation from a teacher through the one loop (`train.distill` in a config):

    train:
      distill: {teacher: runs/transformer, temperature: 2.0, lm_weight: 0.1}

The teacher is any model the zoo loads (a run folder or a Hugging Face model folder: zoo.checkpoint.
load_any), placed on the run's mesh as its own layers shard it, in evaluation mode, never trained. Each
training step runs it on the batch and trains the model on

    loss = lm_weight * CE(y, p_s) + (1 - lm_weight) * t^2 * KL(p_t^(t) || p_s^(t))

per token (Hinton et al. 2015), p^(t) = softmax(logits / t); `distill_kl` in the step's metrics is
the KL at that temperature, and the validation loss stays the model's cross-entropy, so a distilled
run and a run trained from scratch compare directly. The student is any config of the teacher's
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


def teacher_logits(graphdef, params, rest, batch: dict) -> jax.Array:
    """The teacher's logits on a batch, in evaluation mode, outside any gradient."""
    model = nnx.merge(graphdef, params, rest, copy=True)
    return jax.lax.stop_gradient(model(batch["x"], segment_ids=batch.get("segment_ids")))
