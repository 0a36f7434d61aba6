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
state h_l, and every later layer still advances on h_l for that row (CALM's propagation): an attention
layer writes K/V computed from h_l and a recurrent layer advances its state from h_l, so later tokens see
a complete state of every layer. benchmarks/early_exit.py measures what this costs against the ideal of
states from the full-depth hidden states.

Doing that cheaply: once every row of the batch has stopped, a later block only advances its state.
The test is on all rows (`jnp.all(done)`), so the saving is per batch, not per row: a batch of one always
saves; in a batch of B the work past layer l is skipped only at tokens where every row stopped at or
before l, and at other tokens the block runs in full for every row. The branch that advances calls the
block's decode and drops its output, and XLA removes what only that output reads: attention keeps its
K/V projections and cache write (no query, attention or output projection: 2 of an attention block's 9
matmuls; alone, 68 against 604 us per token at d_model 512 on CPU, the time of K/V written by hand), a
recurrent layer its state update (no output path), and the FFN goes, except a stateful one (RWKV's
channel mix), whose token shift reads the mixer's output: there the mixer runs whole and only the FFN's
matmuls go. The exit heads and the final head are skipped too. The blocks branch through `when` (a
while loop of 0 or 1 trips, which updates a KV cache in place), the heads through `lax.cond`. Tokens and
states are those of running every block in full (`full_blocks=True`, the reference, kept for the tests
and the benchmark): the states bitwise under XLA's default CPU optimisation, and to rounding where a
compiler fuses the smaller branch differently.

The pass is a `step` of `LanguageModel.walk`, the model's one loop over its blocks: on a mesh it runs
the blocks under the sharding hints of plain decoding (tests/train/test_sharding.py).

Self-speculative decoding, which drafts with the first layers and an exit, is infer/speculative.py.
"""

import functools

import jax
import jax.numpy as jnp

MEASURES = ("softmax", "margin", "saturation", "classifier")


def confidence(model, measure: str, j: int, h, h_prev, logits):
    """Confidence (B,) of exit j: h, h_prev (B, D) hidden states, logits (B, V) float32."""
    if measure == "softmax":
        return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    if measure == "margin":  # top_k(p, 2) without its sort (slow on CPU): the max, and the max without one argmax
        p = jax.nn.softmax(logits, axis=-1)
        first = jnp.argmax(p, axis=-1)
        rest = jnp.where(jnp.arange(p.shape[-1]) == first[:, None], -jnp.inf, p)
        return jnp.max(p, axis=-1) - jnp.max(rest, axis=-1)
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


def when(pred, f, *args):
    """f(*args) if pred else args (f returns the pytree it takes), as a while loop of 0 or 1 trips rather than
    a `lax.cond`: of a buffer that the branches of a conditional update in place, such as a KV cache, XLA
    (CPU) keeps a copy at the end of every branch but the first, while a while loop updates its state in
    place. Measured (d_model 128, 4096 cache slots, every token at the first exit): 757 us per token with
    lax.cond, 508 with this."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (False, *f(*c[1:])), (pred, *args))[1:]


def exit_pass(model, tokens, state, *, stop_rule, segment_ids=None, freeze: bool = True, skip: bool = False,
              full_blocks: bool = False):
    """Run `tokens` (B, T) through the blocks from `state`, deciding exits at the last position.

    stop_rule(j, h, h_prev, logits) -> (B,) bool says which rows stop at exit j. With `freeze`, a stopped
    row's hidden state is held for the later blocks (T must be 1); once every row has stopped, a later
    block only advances its state from it (the module docstring), unless `full_blocks` (every block runs in
    full: the reference, same result). With `skip`, blocks that every row has passed are not run at all
    (their state is left as it was). Returns the chosen next-token logits (B, V), the layer count each row
    used (B,), and the new state."""
    B = tokens.shape[0]
    where = {layer: j for j, layer in enumerate(model.exit_layers)}
    lean = skip or (freeze and not full_blocks)  # work past the exits is cut once every row has stopped
    x = model.embed_tokens(tokens)

    def step(i, run, x, rest, carry):
        """Block i (`LanguageModel.walk`), then exit i + 1's decision if there is one."""
        done = carry[2]
        if lean and i >= model.exit_layers[0]:  # v_first is set by now: both branches return one pytree
            past = (lambda x, rest: (x, rest)) if skip else (lambda x, rest: (x, run(x, rest)[1]))
            y, rest = when(~jnp.all(done), run, *when(jnp.all(done), past, x, rest))  # one of them
        else:
            y, rest = run(x, rest)
        y = jnp.where(done[:, None, None], x, y) if freeze else y
        if i + 1 in where:
            decide = functools.partial(_decide, model, stop_rule, where[i + 1], i + 1)
            carry = jax.lax.cond(jnp.all(done), lambda y, c: c, decide, y, carry) if lean else decide(y, carry)
        return y, rest, carry

    done, used = jnp.zeros((B,), bool), jnp.full((B,), model.cfg.num_layers, jnp.int32)
    chosen = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    carry = (chosen, used, done, x[:, -1])  # the hidden state at the last exit passed: the embedding's at first
    x, state, (chosen, used, done, _) = model.walk(x, state, segment_ids=segment_ids, step=step, carry=carry)
    final = lambda x, chosen: jnp.where(done[:, None], chosen, model.logits(x[:, -1:])[:, 0])
    chosen = jax.lax.cond(jnp.all(done), lambda x, c: c, final, x, chosen) if lean else final(x, chosen)
    return chosen, used, state


def _decide(model, stop_rule, j: int, layer: int, x, carry):
    """Exit j (after `layer` blocks) for the rows not yet stopped: the new (chosen, used, done, h_prev)."""
    chosen, used, done, h_prev = carry
    h = x[:, -1]
    logits = model.exit_logits(j, x[:, -1:])[:, 0]
    stop = ~done & stop_rule(j, h, h_prev, logits)
    return jnp.where(stop[:, None], logits, chosen), jnp.where(stop, layer, used), done | stop, h


def prompt_depth(model, tokens, segment_ids, measure: str, threshold):
    """A depth per row from its prompt: the shallowest exit whose confidence, averaged over the prompt's
    own tokens (segment_ids == 1), reaches the threshold; else the full depth. Returns (B,) int32."""
    _, hidden = model(tokens, segment_ids=segment_ids, return_exits=True)
    mask = (segment_ids == 1).astype(jnp.float32)
    depth = jnp.full(tokens.shape[:1], model.cfg.num_layers, jnp.int32)
    h_prev = model.embed_tokens(tokens)
    B, T = tokens.shape
    flat = lambda a: a.reshape(B * T, *a.shape[2:])
    for j in reversed(range(len(hidden))):  # the shallowest passing exit is written last
        h, prev = hidden[j], hidden[j - 1] if j else h_prev
        conf = confidence(model, measure, j, flat(h), flat(prev), flat(model.exit_logits(j, h))).reshape(B, T)
        mean = jnp.sum(conf * mask, -1) / jnp.sum(mask, -1)
        depth = jnp.where((mean >= threshold) & (threshold < 1), model.exit_layers[j], depth)  # as `confident`
    return depth
