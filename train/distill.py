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

Sequence-level (black-box) distillation, for a teacher known by its outputs: write a corpus of its
generations, then train any model on it as on any corpus (data.corpus: the folder):

    python -m train.distill runs/transformer --out corpora/teacher --docs 512 --tokens 256 --temperature 1
"""

import argparse
from pathlib import Path

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


def write_corpus(model, tokenizer, out, *, docs: int, tokens: int, prompts=("\n",), batch_size: int = 16,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> list[Path]:
    """`docs` generations of `model` (each a prompt, cycled through `prompts`, and up to `tokens` new tokens,
    sampled at `temperature` with `top_k`, seed + batch index) written as out/doc<i>.txt: a corpus folder
    the data pipeline reads (data.corpus). Returns the files."""
    import infer

    if docs < 1 or tokens < 1 or batch_size < 1:
        raise ValueError(f"write_corpus: docs={docs}, tokens={tokens}, batch_size={batch_size}; expected positive "
                         "counts")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for b, start in enumerate(range(0, docs, batch_size)):
        rows = [prompts[i % len(prompts)] for i in range(start, min(start + batch_size, docs))]
        texts = infer.generate_text(model, rows, max_new_tokens=tokens, tokenizer=tokenizer, seed=seed + b,
                                    sampling=infer.Sampling(temperature, top_k=top_k))
        for i, (prompt, text) in enumerate(zip(rows, texts, strict=True)):
            files.append(out / f"doc{start + i:06d}.txt")
            files[-1].write_text(prompt + text)
    return files


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Write a corpus of a teacher's generations (sequence-level distillation).")
    p.add_argument("teacher", help="a run folder or a Hugging Face model folder")
    p.add_argument("--out", required=True, help="the corpus folder to write (one .txt per document)")
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per document")
    p.add_argument("--prompt", action="append", help="a document's start, cycled (repeatable; default a newline)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None):
    from zoo.checkpoint import load_any

    args = parser().parse_args(argv)
    model, tok = load_any(args.teacher)
    files = write_corpus(model, tok, args.out, docs=args.docs, tokens=args.tokens, prompts=args.prompt or ["\n"],
                         batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(f"wrote {len(files)} documents to {args.out}")


if __name__ == "__main__":
    main()
