"""Speculative decoding: a cheap drafter proposes k tokens, the target model checks them in one pass.

Drafters: the target's own first `draft_layers` layers and that exit's head (self-speculation,
LayerSkip, Elhoushi et al. 2024), or any other model with the same vocabulary (Leviathan et al. 2023;
Chen et al. 2023), e.g. a 1-layer Mamba drafting for a Transformer.

A round, for every row b of the batch at once (fixed shapes, one compile):

    draft     d_1 .. d_k       from the drafter, starting by feeding `last` (the newest kept token)
    verify    p_0 .. p_k       the target's distributions after last, d_1, .., d_k: one decode of k + 1
                               tokens with `steps=True`, which keeps every layer's state after each token
    accept    n_b              greedy: the longest prefix with d_t = argmax p_{t-1}; sampling: d_t is
                               kept with probability min(1, p_{t-1}(d_t) / q_{t-1}(d_t)) up to the first
                               rejection (Leviathan et al. 2023, Algorithm 1)
    next      x_b              greedy: argmax p_n; sampling: from norm(max(p_n - q_n, 0)) after a
                               rejection, else from p_k
    rollback                   every layer to its state after last, d_1, .., d_{n_b} (model.rollback:
                               an attention cache moves its row's index, a recurrent layer takes its
                               state at that step); no token runs twice, in the target or the drafter

Each row keeps its own n_b and advances by n_b + 1 tokens (per-row cache positions), so one row's
rejection does not hold the others back. Greedy verification gives exactly plain greedy decoding's
tokens; sampled verification gives exactly the target's sampling distribution (temperature, top-k and
top-p applied to target and drafter alike). A draft model is fed last, d_1, .., d_k (k + 1 steps, the
last one only to advance its state), so after any n_b its state is one rollback away.

Token trees (`tree`, greedy only): branching factors (w_1, .., w_m) for the first m draft positions;
each of the P = w_1 ... w_m paths takes, at depth i <= m, the r_i-th most likely draft token (r_i its
digit in that mixed radix) and continues greedily to depth k. Every mixer checks the tree by running
its paths as rows from the shared state (the state repeated P times: exact for every kind); the path
with the longest accepted prefix wins. For attention this copies the KV cache once per path and
round: a tree pays while P x (k + 1) tokens cost about what one token costs (a weight-bound step) and
the cache is short. A tree mask over one shared cache (SpecInfer) would avoid the copy; not built.
"""

import itertools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from layers.state import join_steps, take_rows, without_final


def warp(logits, temperature, top_k: int | None, top_p):
    """Logits (..., V) as sampling sees them: scaled, -inf outside the top-k and the top-p nucleus."""
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the smallest set whose mass reaches top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def tree_digits(tree: tuple, k: int) -> jax.Array:
    """(P, k) int32: path p's rank of the draft token at each depth (0, the greedy token, past the tree)."""
    return jnp.asarray([list(p) + [0] * (k - len(p)) for p in itertools.product(*(range(w) for w in tree))],
                       jnp.int32)


class Drafter(NamedTuple):
    step: Callable  # (tok (B,), state) -> (logits (B, V), state, that step's stepped state or None)
    start: Callable  # (target state, drafter state) -> the state the round drafts from
    rollback: Callable | None  # (stepped, drop) -> state; None: the drafter keeps no state of its own
    feeds: int  # tokens fed per round: k, or k + 1 when the state must also take d_k


def self_drafter(model, layers: int, k: int) -> Drafter:
    """The target's first `layers` layers and their exit. It drafts from a copy of the round's states of
    those layers, which the verify pass recomputes from the round's start: nothing to roll back."""
    j = model.exit_layers.index(layers)

    def step(tok, states):
        x, states, _ = model.walk(model.embed_tokens(tok[:, None]), states, depth=layers)
        return model.exit_logits(j, x)[:, 0], states, None

    return Drafter(step, lambda state, _: tuple(state[:layers]), None, k)


def model_drafter(model, k: int) -> Drafter:
    """Another model with the same vocabulary, fed last, d_1, .., d_k so that any n is a rollback away."""
    def step(tok, state):
        logits, stepped = model.decode(tok[:, None], state, steps=True)
        return logits[:, 0], model.rollback(stepped, jnp.zeros(tok.shape, jnp.int32)), without_final(stepped)

    return Drafter(step, lambda _, draft_state: draft_state, model.rollback, k + 1)


def accept_greedy(drafts, target_logits):
    """Greedy verification: n (B,), the longest prefix of drafts (B, k) equal to the target's argmax after
    the tokens before them, and the target's argmax after that prefix (B,)."""
    full = jnp.argmax(target_logits, -1).astype(jnp.int32)  # (B, k + 1)
    n = jnp.sum(jnp.cumprod(drafts == full[:, :-1], axis=1), axis=1)  # (B,)
    return n, jnp.take_along_axis(full, n[:, None], 1)[:, 0]


def accept_sampled(drafts, draft_logits, target_logits, key):
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) on warped logits: drafts (B, k) drawn
    from softmax(draft_logits) (B, k, V), target_logits (B, k + 1, V). Returns n (B,) and the next token."""
    B, k = drafts.shape
    p, q = jax.nn.softmax(target_logits, -1), jax.nn.softmax(draft_logits, -1)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]  # (B, k)
    q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]  # > 0: each draft was drawn from q
    u_key, x_key = jax.random.split(key)
    n = jnp.sum(jnp.cumprod(jax.random.uniform(u_key, (B, k)) * q_d < p_d, axis=1), axis=1)  # u < p / q
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]  # (B, V)
    q_n = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), n[:, None, None], 1)[:, 0]  # 0 if n = k
    residual = jnp.maximum(p_n - q_n, 0)  # all zero only where p_n = q_n, when no rejection can happen
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    return n, jax.random.categorical(x_key, jnp.log(residual), axis=-1).astype(jnp.int32)


def speculative_round(model, drafter: Drafter, last, state, draft_state, key, *, k: int, tree: tuple, warp_fn,
                      greedy: bool):
    """One round: the kept tokens (B, k + 1) (the n accepted drafts and the next token, -1 after), n (B,),
    and the target's and the drafter's states after last and the n accepted drafts."""
    B = last.shape[0]
    digits = tree_digits(tree, k)
    P, W = digits.shape[0], max(tree, default=1)
    digits = jnp.tile(digits, (B, 1))  # (B P, k): row b P + p is path p of row b
    widen = (lambda s: jax.tree.map(lambda a: jnp.repeat(a, P, axis=0), s)) if P > 1 else (lambda s: s)
    draft_key, accept_key = jax.random.split(key)

    def pick(logits, t):
        if not greedy:
            return jax.random.categorical(jax.random.fold_in(draft_key, t), warp_fn(logits), -1).astype(jnp.int32)
        ranked = jax.lax.top_k(logits, W)[1]  # (B P, W)
        return jnp.take_along_axis(ranked, digits[:, t, None], 1)[:, 0].astype(jnp.int32)

    def body(carry, t):
        tok, s = carry
        logits, s, stepped = drafter.step(tok, s)
        nxt = pick(logits, t)
        return (nxt, s), (nxt, logits, stepped)

    last = jnp.repeat(last, P)
    start = widen(drafter.start(state, draft_state))
    (_, d_after), (toks, q_logits, d_steps) = jax.lax.scan(body, (last, start), jnp.arange(drafter.feeds))
    drafts, q_logits = toks[:k].T, q_logits[:k].transpose(1, 0, 2)  # (B P, k), (B P, k, V)
    logits, stepped = model.decode(jnp.concatenate([last[:, None], drafts], axis=1), widen(state), steps=True)
    if greedy:
        n, nxt = accept_greedy(drafts, logits)
    else:
        n, nxt = accept_sampled(drafts, warp_fn(q_logits), warp_fn(logits), accept_key)
    d_steps = join_steps(d_after, d_steps) if drafter.rollback else None
    if P > 1:  # each row keeps its first path with the most accepted drafts
        rows = jnp.arange(B) * P + jnp.argmax(n.reshape(B, P), axis=1)
        drafts, n, nxt = drafts[rows], n[rows], nxt[rows]
        stepped, d_steps = take_rows(stepped, rows), d_steps if d_steps is None else take_rows(d_steps, rows)
    state = model.rollback(stepped, k - n)
    draft_state = drafter.rollback(d_steps, k - n) if drafter.rollback else draft_state
    slots = jnp.arange(k + 1)
    kept = jnp.where(slots < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), -1)
    return jnp.where(slots == n[:, None], nxt[:, None], kept), n, state, draft_state
