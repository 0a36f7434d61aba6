"""Early exit at decoding time, for every mixer: token-level exits (CALM) and a depth per sequence.
Used by `infer.generate`; all functions run under its jit.

Confidence of exit j for a row, from its hidden state h_j (B, D) and exit logits z_j:

    softmax     max_v softmax(z_j)
    margin      p(1) - p(2), the top-1 minus the top-2 probability
    saturation  max(0, cos(h_j, h_prev)), h_prev the hidden state at the previous exit (the embedding at
                the first); clipped at 0 so that every measure lies in [0, 1]
    classifier  sigmoid(w_j . norm_j(h_j) + b_j), fitted on the frozen model (train/exits.py)

A row stops at the first exit whose confidence reaches the threshold λ_t (threshold 0: always the first
exit; 1: never). With a decay τ > 0 the threshold falls along the output as CALM's eq. 5,
λ_t = clip((9 λ + exp(-τ t / N)) / 10, 0, 1), t the index of the token and N = max_new_tokens.

State of the layers a token skips (the choice made here): a row that stops at layer l keeps its hidden
state h_l, and every later block still runs on h_l for that row; its output is discarded, but an
attention layer writes K/V computed from h_l (CALM's propagation) and a recurrent layer advances its
state from h_l, so later tokens see a complete state of every layer. benchmarks/early_exit.py measures
what this costs against the ideal of states from the full-depth hidden states. Because every block still
runs, token-level exit here buys accuracy-per-layer figures, not wall time; a depth per sequence
(`level="sequence"`) skips the layers past it for real, since no later token reads them.

Self-speculative decoding, which drafts with the first layers and an exit, is infer/speculative.py.
"""

import jax
import jax.numpy as jnp

MEASURES = ("softmax", "margin", "saturation", "classifier")


def confidence(model, measure: str, j: int, h, h_prev, logits):
    """Confidence (B,) of exit j: h, h_prev (B, D) hidden states, logits (B, V) float32."""
    if measure == "softmax":
        return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    if measure == "margin":
        top = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), 2)[0]
        return top[:, 0] - top[:, 1]
    if measure == "saturation":
        h, h_prev = h.astype(jnp.float32), h_prev.astype(jnp.float32)
        cos = jnp.sum(h * h_prev, -1) * jax.lax.rsqrt(jnp.sum(h * h, -1) * jnp.sum(h_prev * h_prev, -1) + 1e-12)
        return jnp.maximum(cos, 0.0)
    return jax.nn.sigmoid(model.exit_classifier_logits(j, h[:, None])[:, 0])


def confident(model, measure: str, threshold):
    """The stop rule of exit_pass: a row stops at exit j when its confidence reaches the threshold
    (threshold 1 never stops; 0 always does)."""
    return lambda j, h, h_prev, logits: ((confidence(model, measure, j, h, h_prev, logits) >= threshold)
                                         & (threshold < 1))


def threshold_at(threshold, decay: float, t, n: int):
    """CALM's decaying threshold for the t-th generated token of n (decay 0: constant); a threshold
    of 1 stays 1 (never exit)."""
    if decay == 0:
        return threshold
    return jnp.where(threshold < 1, jnp.clip((9 * threshold + jnp.exp(-decay * t / n)) / 10, 0, 1), threshold)


def exit_pass(model, tokens, state, *, stop_rule, segment_ids=None, freeze: bool = True, skip: bool = False):
    """Run `tokens` (B, T) through the blocks from `state`, deciding exits at the last position.

    stop_rule(j, h, h_prev, logits) -> (B,) bool says which rows stop at exit j. With `freeze`, a stopped
    row's hidden state is held for the later blocks (T must be 1); with `skip`, blocks that every row
    has passed are not run at all (their state is left as it was). Returns the chosen next-token logits
    (B, V), the layer count each row used (B,), and the new state."""
    B = tokens.shape[0]
    L = len(model.blocks)
    where = {layer: j for j, layer in enumerate(model.exit_layers)}
    x, v_first = model.embed_tokens(tokens), None
    done, used = jnp.zeros((B,), bool), jnp.full((B,), L, jnp.int32)
    chosen = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    h_prev, new_state = x[:, -1], []
    for i, (block, s) in enumerate(zip(model.blocks, state)):
        if skip and i >= model.exit_layers[0]:  # v_first is set by now: both branches return one pytree
            y, s, v_first = jax.lax.cond(jnp.all(done), lambda x, s, v: (x, s, v),
                                         lambda x, s, v: block.decode(x, s, segment_ids=segment_ids, v_first=v),
                                         x, s, v_first)
        else:
            y, s, v_first = block.decode(x, s, segment_ids=segment_ids, v_first=v_first)
        x = jnp.where(done[:, None, None], x, y) if freeze else y
        new_state.append(s)
        if i + 1 in where:
            j = where[i + 1]
            h = x[:, -1]
            logits = model.exit_logits(j, x[:, -1:])[:, 0]
            stop = ~done & stop_rule(j, h, h_prev, logits)
            chosen = jnp.where(stop[:, None], logits, chosen)
            used = jnp.where(stop, i + 1, used)
            done, h_prev = done | stop, h
    chosen = jnp.where(done[:, None], chosen, model.logits(x[:, -1:])[:, 0])
    return chosen, used, tuple(new_state)


def prompt_depth(model, tokens, segment_ids, measure: str, threshold):
    """A depth per row from its prompt: the shallowest exit whose confidence, averaged over the prompt's
    own tokens (segment_ids == 1), reaches the threshold; else the full depth. Returns (B,) int32."""
    _, hidden = model(tokens, segment_ids=segment_ids, return_exits=True)
    mask = (segment_ids == 1).astype(jnp.float32)
    depth = jnp.full(tokens.shape[:1], len(model.blocks), jnp.int32)
    h_prev = model.embed_tokens(tokens)
    B, T = tokens.shape
    flat = lambda a: a.reshape(B * T, *a.shape[2:])
    for j in reversed(range(len(hidden))):  # the shallowest passing exit is written last
        h, prev = hidden[j], hidden[j - 1] if j else h_prev
        conf = confidence(model, measure, j, flat(h), flat(prev), flat(model.exit_logits(j, h))).reshape(B, T)
        mean = jnp.sum(conf * mask, -1) / jnp.sum(mask, -1)
        depth = jnp.where((mean >= threshold) & (threshold < 1), model.exit_layers[j], depth)  # as `confident`
    return depth
