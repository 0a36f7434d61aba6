"""The jitted computations of training: the forward pass with its losses, the train step (gradient
accumulation over micro-batches, the optimiser update), the evaluation step, and the redraw of
random features. Pure functions of (graphdef, params, rest, ...), so train/loop.py, benchmarks and
tests build the same step.

Layers report training-time losses and metrics by sowing nnx.Intermediate values (MoE: its balance
and z losses, loads, drops); `aux_loss` entries are added to the loss. Non-parameter state that a
layer updates in training (MoE's balancing bias) comes back as the new `rest`.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from infer.quantize import fake_quantize
from train.distill import alignment_loss, kl_per_token, teacher_targets


def _sown_metrics(model) -> dict:
    """The values the layers sowed, by `<sow name>_<metric>`, stacked over layers: (layers, ...)."""
    sown = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))
    out = {}
    for path, value in jax.tree_util.tree_leaves_with_path(sown):  # .../<sow name>/<call>/<metric>
        names = [p.key for p in path if isinstance(getattr(p, "key", None), str)]
        out.setdefault(f"{names[-2]}_{names[-1]}", []).append(value)
    return {k: jnp.stack(v) for k, v in out.items()}


def forward(graphdef, params, rest, batch, train: bool, teacher=None, distill=None, qat=None):
    """One batch: (sum of token losses, counted tokens, correctly predicted tokens (argmax), aux loss,
    layer metrics, new rest). Early exits add their weighted mean losses to `aux` and report them as
    `exit<l>_loss`. With a `distill` config (train/distill.py) and the `teacher`'s targets: at stage
    logits each token's loss is lm_weight * CE + (1 - lm_weight) * t^2 * KL, the KL reported as
    `distill_kl`; at stage layers the loss is the converted mixers' alignment error, `distill_mse`.
    With a `qat` config (train.qat) the model is read in its quantized form (infer/quantize.fake_quantize)."""
    model = nnx.merge(graphdef, params, rest, copy=True)  # copy: layers may write state under grad
    if qat is not None:
        fake_quantize(model, qat.bits, group_size=qat.group_size, activations=qat.activations)
    model.train() if train else model.eval()
    if teacher is not None and distill.stage == "layers":
        loss_sum, mse = alignment_loss(model, teacher, batch, distill)
        new_rest = nnx.state(model, nnx.Not(nnx.Param))
        return loss_sum, jnp.sum(batch["mask"]), jnp.float32(0), jnp.float32(0), {"distill_mse": mse}, new_rest
    logits, hidden = model(batch["x"], segment_ids=batch.get("segment_ids"), return_exits=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    layer_metrics = _sown_metrics(model)
    if teacher is not None:
        kl = kl_per_token(logits, teacher, distill.temperature)
        layer_metrics["distill_kl"] = jnp.sum(kl * batch["mask"]) / jnp.sum(batch["mask"])
        ce = distill.lm_weight * ce + (1 - distill.lm_weight) * distill.temperature ** 2 * kl
    aux = sum((jnp.sum(v) for k, v in layer_metrics.items() if k.endswith("_aux_loss")), jnp.float32(0))
    for j, (h, w) in enumerate(zip(hidden, model.cfg.exits.weights if hidden else ())):  # early exits
        exit_ce = optax.softmax_cross_entropy_with_integer_labels(model.exit_logits(j, h), batch["y"])
        layer_metrics[f"exit{model.exit_layers[j]}_loss"] = jnp.sum(exit_ce * batch["mask"]) / jnp.sum(batch["mask"])
        aux = aux + w * layer_metrics[f"exit{model.exit_layers[j]}_loss"]
    new_rest = nnx.state(model, nnx.Not(nnx.Param))
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["y"]) * batch["mask"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]), correct, aux, layer_metrics, new_rest


def make_train_step(graphdef, tx, out_shardings=None, teacher=None, distill=None, qat=None):
    """step(params, rest, opt_state, batch) with batch leaves shaped (micro_batches, b, T).
    `out_shardings` (params, rest, opt_state, metrics) keeps a sharded state where it was. `teacher`
    (graphdef, params, rest) with a `distill` config (train/distill.py) trains on the teacher's
    targets, computed per micro-batch; its parameters are arguments of the compiled step, not constants.
    `qat` (train.qat) trains the model in its quantized form.

    Gradients of the summed token loss (plus each micro-batch's aux loss weighted by its tokens) are
    accumulated over micro-batches and divided by the total token count once, so k micro-batches
    give the gradient of one batch k times larger. `rest` (e.g. MoE biases) updates per micro-batch."""
    def step(params, rest, opt_state, batch, teacher_state):
        def objective(p, r, b, t):
            loss_sum, count, _, aux, layer_metrics, r = forward(graphdef, p, r, b, True, t, distill, qat)
            return loss_sum + aux * count, (loss_sum, count, layer_metrics, r)

        def micro(acc, b):
            loss_sum, count, layer_metrics, grads, r = acc
            t = None if teacher is None else teacher_targets(teacher[0], *teacher_state, b, distill)
            (_, (ls, n, lm, r)), g = jax.value_and_grad(objective, has_aux=True)(params, r, b, t)
            lm = jax.tree.map(jnp.add, layer_metrics, lm)
            return (loss_sum + ls, count + n, lm, jax.tree.map(jnp.add, grads, g), r), None

        k = jax.tree.leaves(batch)[0].shape[0]
        first = jax.tree.map(lambda x: x[0], batch)
        shapes = jax.eval_shape(lambda: forward(graphdef, params, rest, first, True, None if teacher is None else
                                                teacher_targets(teacher[0], *teacher_state, first, distill), distill,
                                                qat))
        zeros = (jnp.float32(0), jnp.float32(0), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[4]),
                 jax.tree.map(jnp.zeros_like, params), rest)
        (loss_sum, count, layer_metrics, grads, rest), _ = jax.lax.scan(micro, zeros, batch)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        loss, grad_norm = loss_sum / count, optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
                   "finite_grads": jax.tree.map(lambda g: jnp.isfinite(g).all(), grads),  # named when a step fails
                   "layers": jax.tree.map(lambda x: x / k, layer_metrics)}
        return optax.apply_updates(params, updates), rest, opt_state, metrics

    jitted = jax.jit(step, donate_argnums=(0, 2), out_shardings=out_shardings)
    return functools.partial(jitted, teacher_state=None if teacher is None else teacher[1:])


def make_eval_step(graphdef, out_shardings=None, qat=None):
    """evaluate(params, rest, batch) -> (sum of token losses, counted tokens, correct tokens) of a
    (B, T) batch, in evaluation mode (with `qat`, in the quantized form it trains)."""
    return jax.jit(lambda p, r, b: forward(graphdef, p, r, b, train=False, qat=qat)[:3], out_shardings=out_shardings)


def redraw_features(graphdef, params, rest, key):
    """New random features in every layer that has them (Performer); returns the new `rest`."""
    model = nnx.merge(graphdef, params, rest, copy=True)  # leave the caller's `rest` untouched
    found = [m for _, m in nnx.iter_modules(model) if getattr(m, "feature_map", None) == "performer"]
    for i, m in enumerate(found):
        m.redraw_features(jax.random.fold_in(key, i))
    return nnx.split(model, nnx.Param, ...)[2]
