"""Fit the early-exit confidence classifiers on a frozen model (CALM's learned exit measure).

For each exit j the label of a token is whether exit j's top token equals the full model's top
token there (CALM's "consistency" oracle), and the classifier is a logistic regression on the exit's
normed hidden state (LanguageModel.exit_classifier_logits). Only the classifier weights move: every other
parameter is frozen, so fitting after pretraining changes nothing else the model does.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def fit_exit_classifiers(model, batch_at, *, steps: int, lr: float = 1e-2) -> list[float]:
    """Fit `model.exit_classifier` in place for `steps` Adam steps on `batch_at(i)` (dicts with "x",
    "mask" and optionally "segment_ids"); returns the mean binary cross-entropy of each step."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(lr)

    def loss_fn(wb, params, batch):
        m = nnx.merge(graphdef, params, rest, copy=True)
        m.eval()
        logits, hidden = m(batch["x"], segment_ids=batch.get("segment_ids"), return_exits=True)
        target = jnp.argmax(logits, -1)
        m.exit_classifier[...] = wb
        total = 0.0
        for j, h in enumerate(hidden):
            label = (jnp.argmax(m.exit_logits(j, h), -1) == target).astype(jnp.float32)
            logit = m.exit_classifier_logits(j, h)
            total += jnp.sum(optax.sigmoid_binary_cross_entropy(logit, label) * batch["mask"]) / jnp.sum(batch["mask"])
        return total / len(hidden)

    @jax.jit
    def step(wb, opt_state, params, batch):
        loss, g = jax.value_and_grad(loss_fn)(wb, params, batch)
        updates, opt_state = tx.update(g, opt_state, wb)
        return optax.apply_updates(wb, updates), opt_state, loss

    wb = model.exit_classifier[...]
    opt_state, losses = tx.init(wb), []
    for i in range(steps):
        wb, opt_state, loss = step(wb, opt_state, params, batch_at(i))
        losses.append(float(loss))
    model.exit_classifier[...] = wb
    return losses
