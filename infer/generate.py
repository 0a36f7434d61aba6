"""Batched generation: prefill and the whole decode loop under one jit, on fixed-shape state.

Prompts of different lengths are left-padded into one (B, P) batch; the padding is its own document
(segment 0, the prompt segment 1), so attention never sees it and a recurrent layer restarts from a
zero state at the prompt's first token: each row gets exactly what it gets alone. The loop is a
`lax.while_loop` that stops when every row has hit `stop_token` or `max_new_tokens`; one compile per
(batch, padded prompt length, max_new_tokens, sampling flags, early-exit settings). Early exit and
speculative decoding (infer/speculative.py, its own loop) run inside one jit. A model whose parameters
are sharded over a device mesh (zoo/sharding.py) decodes the same way: jit partitions prefill and
loop from the parameters' shardings, and the tokens are those of one device.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jaxtyping import Array, Float, Int

from infer import early_exit, speculative
from infer.quantize import quantize as quantize_model
from layers.state import hold
from zoo import tokenizer as tokenizer_lib

TRACES = {"generate": 0}  # incremented at trace time: tests check the loop compiles once


def sample_logits(logits: Float[Array, "B V"], key, temperature, top_k: int | None, top_p, greedy: bool
                  ) -> Int[Array, " B"]:
    """Pick one token per row from float32 logits (B, V); temperature and top_p are scalars (traced),
    top_p None for no nucleus cut."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, speculative.warp(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Exits:
    """How `_generate` exits early (static under jit): see infer/early_exit.py."""
    measure: str = "softmax"
    level: str = "token"  # "token" or "sequence"
    decay: float = 0.0
    full_blocks: bool = False  # token level: run skipped blocks in full (the reference; same tokens, slower)


# Decode loops carry every layer's state through a while loop. XLA on CPU copies a loop-carried buffer
# it cannot prove is read before it is updated; its region analysis proves it for the KV cache, which
# attention reads before writing (kernels/attention/__init__.py `attention_cached`): GQA at 4K slots,
# 2.0 -> 1.5 ms per token (benchmarks/decode.py). Other backends ignore the option.
DECODE_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "greedy", "use_top_p", "exits"),
                   compiler_options=DECODE_OPTIONS)
def _generate(graphdef, params, tokens, segment_ids, key, temperature, top_p, stop_token, threshold, *,
              max_new_tokens: int, top_k, greedy: bool, use_top_p: bool, exits: Exits | None):
    """(tokens (B, max_new_tokens) with -1 after the end, layers used per token, overflowed)."""
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()  # no training-time side effects (MoE jitter, bias updates) inside the loop
    B, P = tokens.shape
    L = len(model.blocks)
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k,
                               top_p=top_p if use_top_p else None, greedy=greedy)
    state = model.init_state(B, P + max_new_tokens)
    if exits is None:
        def step(last, state, i):
            logits, state = model.decode(last[:, None], state)
            return logits[:, -1], state, jnp.full((B,), L)

        logits, state = model.decode(tokens, state, segment_ids=segment_ids)
        logits, used = logits[:, -1], jnp.full((B,), L)
    else:
        if exits.level == "sequence":
            depth = early_exit.prompt_depth(model, tokens, segment_ids, exits.measure, threshold)
            rule = lambda i: lambda j, h, h_prev, z: depth == model.exit_layers[j]
        else:
            rule = lambda i: early_exit.confident(
                model, exits.measure, early_exit.threshold_at(threshold, exits.decay, i, max_new_tokens))

        def step(last, state, i):
            logits, used, state = early_exit.exit_pass(model, last[:, None], state, stop_rule=rule(i),
                                                       skip=exits.level == "sequence",
                                                       full_blocks=exits.full_blocks)
            return logits, state, used

        logits, used, state = early_exit.exit_pass(model, tokens, state, stop_rule=rule(0), segment_ids=segment_ids,
                                                   freeze=False)
    first = sample(logits, jax.random.fold_in(key, 0))
    out = jnp.full((B, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    layers = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(used)

    def cond(carry):
        i, _, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, state, last, out, layers, done = carry
        logits, state, used = step(last, state, i)
        tok = sample(logits, jax.random.fold_in(key, i))
        out = jax.lax.dynamic_update_slice(out, jnp.where(done, -1, tok)[:, None], (0, i))
        layers = jax.lax.dynamic_update_slice(layers, jnp.where(done, 0, used)[:, None], (0, i))
        return i + 1, state, tok, out, layers, done | (tok == stop_token)

    _, state, _, out, layers, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), state, first, out, layers, first == stop_token))
    return out, layers, model.overflowed(state)


@functools.partial(jax.jit, static_argnames=("graphdef", "draft_graphdef", "max_new_tokens", "top_k", "greedy",
                                             "use_top_p", "k", "draft_layers", "tree"),
                   compiler_options=DECODE_OPTIONS)
def _speculate(graphdef, params, draft_graphdef, draft_params, tokens, segment_ids, key, temperature, top_p,
               stop_token, *, max_new_tokens: int, top_k, greedy: bool, use_top_p: bool, k: int, draft_layers,
               tree: tuple):
    """Speculative decoding (infer/speculative.py): (tokens (B, max_new_tokens) with -1 after the end,
    accepted drafts per row, rounds per row, overflowed). Row b has produced i[b] tokens; it is active
    until it reaches max_new_tokens or the stop token, and an inactive row's states are held."""
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()
    B, P = tokens.shape
    size = P + max_new_tokens + k + 1  # an active row has fed at most max_new_tokens - 1 tokens, + k + 1 checked
    warp_fn = lambda logits: speculative.warp(logits, temperature, top_k, top_p if use_top_p else None)
    if draft_graphdef is None:
        drafter, draft_state = speculative.self_drafter(model, draft_layers, k), None
    else:
        draft = nnx.merge(draft_graphdef, draft_params)
        draft.eval()
        drafter = speculative.model_drafter(draft, k)
        draft_state = draft.decode(tokens, draft.init_state(B, size), segment_ids=segment_ids)[1]
    logits, state = model.decode(tokens, model.init_state(B, size), segment_ids=segment_ids)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k,
                          top_p if use_top_p else None, greedy)
    out = jnp.full((B, max_new_tokens + k + 1), -1, jnp.int32).at[:, 0].set(first)
    write = jax.vmap(lambda row, kept, i: jax.lax.dynamic_update_slice(row, kept, (i,)))
    zeros = jnp.zeros((B,), jnp.int32)

    def body(carry):
        r, i, state, draft_state, last, out, done, accepted, rounds = carry
        kept, n, new_state, new_draft_state = speculative.speculative_round(
            model, drafter, last, state, draft_state, jax.random.fold_in(key, r + 1), k=k, tree=tree,
            warp_fn=warp_fn, greedy=greedy)
        active = ~done
        state, draft_state = hold(active, state, new_state), hold(active, draft_state, new_draft_state)
        out = write(out, jnp.where(active[:, None], kept, -1), i)
        i = i + jnp.where(active, n + 1, 0)
        done = done | jnp.any(kept == stop_token, axis=1) | (i >= max_new_tokens)
        last = jnp.where(active, jnp.take_along_axis(kept, n[:, None], 1)[:, 0], last)
        return (r + 1, i, state, draft_state, last, out, done, accepted + jnp.where(active, n, 0),
                rounds + active)

    done = (first == stop_token) | (max_new_tokens == 1)
    carry = (jnp.int32(0), zeros + 1, state, draft_state, first, out, done, zeros, zeros)
    _, _, state, _, _, out, _, accepted, rounds = jax.lax.while_loop(lambda c: ~jnp.all(c[6]), body, carry)
    return out[:, :max_new_tokens], accepted, rounds, model.overflowed(state)


def generate(model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, stop_token: int | None = None,
             exit_threshold: float | None = None, exit_measure: str = "softmax", exit_decay: float = 0.0,
             exit_level: str = "token", speculative: int | None = None, draft_layers: int | None = None,
             draft_model=None, tree: tuple[int, ...] | None = None, quantize: str | None = None,
             kv_cache: str | None = None, return_info: bool = False, exit_full_blocks: bool = False):
    """New token ids for each prompt (a list of token-id lists of any lengths).

    temperature 0 is greedy; top_k / top_p restrict sampling; a row ends after `stop_token` (which is
    not returned) or `max_new_tokens`. The same seed gives the same tokens.

    Early exit (a model with `model.exits`, see infer/early_exit.py): `exit_threshold` in [0, 1] turns it
    on, with `exit_measure` (softmax, margin, saturation, classifier), `exit_decay` (CALM's threshold
    decay along the output) and `exit_level` (token: decided per token and row; sequence: one depth per
    row, chosen from its prompt). At the token level, the layers past the exit only advance their state
    (no output path) at a token where every row of the batch has exited (batch 1: every token); at other
    tokens they run in full; `exit_full_blocks` always runs them in full (the same tokens and states,
    slower: the reference).

    Speculative decoding (infer/speculative.py): `speculative=k` drafts k tokens per round, with
    `draft_model` (any model of the same vocabulary) or else the first `draft_layers` layers of this
    model and their exit (default the first exit), and verifies them in one pass. Greedy (temperature
    0) gives exactly plain greedy decoding's tokens; sampling gives exactly plain sampling's
    distribution. `tree=(w_1, .., w_m)` (greedy only) checks w_1 ... w_m draft paths per round, branching
    into the w_i most likely draft tokens at depth i.

    With `return_info`, also returns a dict with `exit_layers` (the layers each token used, per row)
    and, when speculating, `acceptance` (accepted drafts / drafted tokens) and `rounds` (summed over rows).

    `quantize` ("int8" or "int4") and `kv_cache` ("int8") decode with a quantized copy of the model (and
    of the draft model), made on each call by `infer.quantize` (infer/quantize.py, with its defaults:
    W8A8 products, int4 groups of 32); to decode many times, call `infer.quantize` once and pass its
    model instead.
    """
    if quantize is not None or kv_cache is not None:
        model = quantize_model(model, weights=quantize, kv_cache=kv_cache)
        draft_model = draft_model and quantize_model(draft_model, weights=quantize, kv_cache=kv_cache)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token (e.g. a newline byte)")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    V = model.cfg.vocab_size
    if temperature < 0 or (top_k is not None and not 1 <= top_k <= V) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"generate: need temperature >= 0, 1 <= top_k <= {V} (the vocabulary), 0 < top_p <= 1; "
                         f"got temperature={temperature}, top_k={top_k}, top_p={top_p}")
    bad = [(i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < V]
    if bad:
        raise ValueError(f"generate: token ids must be in [0, {V}) (model.vocab_size); prompt {bad[0][0]} holds "
                         f"{bad[0][1]}")
    if stop_token is not None and not 0 <= stop_token < V:
        raise ValueError(f"generate: stop_token={stop_token} is not a token id in [0, {V})")
    if speculative is None and (draft_model is not None or tree is not None or draft_layers is not None):
        raise ValueError("generate: draft_model, draft_layers and tree need speculative=k (the draft length)")
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    segments = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = p
        segments[i, P - len(p):] = 1
    graphdef, params = nnx.split(model)
    args = (jnp.asarray(tokens), jnp.asarray(segments), jax.random.key(seed), jnp.float32(max(temperature, 1e-6)),
            jnp.float32(top_p or 1.0), jnp.int32(-2 if stop_token is None else stop_token))
    flags = dict(max_new_tokens=max_new_tokens, top_k=top_k, greedy=temperature == 0, use_top_p=top_p is not None)
    if speculative is not None:
        if exit_threshold is not None:
            raise ValueError("generate: give exit_threshold or speculative, not both")
        draft_layers, tree = _speculation(model, temperature, speculative, draft_layers, draft_model, tree)
        draft_graphdef, draft_params = nnx.split(draft_model) if draft_model is not None else (None, None)
        out, accepted, rounds, overflowed = _speculate(
            graphdef, params, draft_graphdef, draft_params, *args, **flags, k=speculative, draft_layers=draft_layers,
            tree=tree)
        layers = jnp.full(out.shape, len(model.blocks), jnp.int32)
    else:
        exits = _exits(model, exit_threshold, exit_measure, exit_decay, exit_level)
        exits = exits and dataclasses.replace(exits, full_blocks=exit_full_blocks)
        out, layers, overflowed = _generate(
            graphdef, params, *args, jnp.float32(1.0 if exit_threshold is None else exit_threshold), **flags,
            exits=exits)
        accepted = rounds = jnp.zeros((), jnp.int32)
    if not out.is_fully_addressable:  # params spread over several processes: every one gets all of it
        out, layers, accepted, rounds, overflowed = multihost_utils.process_allgather(
            (out, layers, accepted, rounds, overflowed), tiled=True)
    if np.any(overflowed):  # the cache is sized for prompt + max_new_tokens (+ k + 1 checked): a bug, never silent
        raise RuntimeError("generate: a KV cache overflowed its slots; this is a bug in generate, please report it")
    rows, used = [], []
    for row, row_layers in zip(np.asarray(out).tolist(), np.asarray(layers).tolist()):
        n = row.index(-1) if -1 in row else len(row)
        n = min(n, row.index(stop_token)) if stop_token in row else n
        rows.append(row[:n])
        used.append(row_layers[:n])
    if not return_info:
        return rows
    info = {"exit_layers": used}
    if speculative:
        rounds = int(np.sum(rounds))
        info.update(rounds=rounds, acceptance=int(np.sum(accepted)) / max(rounds * speculative, 1))
    return rows, info


def _exits(model, threshold, measure, decay, level) -> Exits | None:
    """Check the early-exit arguments against the model; None when early exit is off."""
    if threshold is None:
        return None
    if not getattr(model, "exit_layers", ()):
        raise ValueError("generate: early exit needs a model with exits (model.exits in its config, e.g. "
                         "configs/early_exit.yaml)")
    if not 0 <= threshold <= 1:
        raise ValueError(f"generate: exit_threshold must be in [0, 1], got {threshold}")
    if measure not in early_exit.MEASURES or level not in ("token", "sequence") or decay < 0:
        raise ValueError(f"generate: exit_measure must be one of {', '.join(early_exit.MEASURES)}, exit_level "
                         f"token or sequence, exit_decay >= 0; got {measure!r}, {level!r}, {decay}")
    return Exits(measure=measure, level=level, decay=float(decay))


def _speculation(model, temperature, k, draft_layers, draft_model, tree) -> tuple[int | None, tuple]:
    """Check the speculative-decoding arguments; returns (draft_layers, tree) as `_speculate` takes them."""
    if k < 1:
        raise ValueError(f"generate: speculative=k needs k >= 1 draft tokens, got {k}")
    tree = tuple(tree or ())
    if tree and (temperature != 0 or any(w < 1 for w in tree) or len(tree) > k):
        raise ValueError(f"generate: tree={tree} needs greedy decoding (temperature 0), branching factors >= 1 "
                         f"and at most k={k} levels")
    if draft_model is not None:
        if draft_layers is not None:
            raise ValueError("generate: give draft_model or draft_layers (self-speculation), not both")
        if draft_model.cfg.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"generate: the draft model's vocabulary ({draft_model.cfg.vocab_size}, model.vocab_size) "
                             f"differs from the target's ({model.cfg.vocab_size}); both need one tokenizer")
        return None, tree
    layers = getattr(model, "exit_layers", ())
    if not layers:
        raise ValueError("generate: speculative decoding needs a draft_model, or a model with exits (model.exits "
                         "in its config, e.g. configs/early_exit.yaml) to draft with its first layers")
    draft_layers = layers[0] if draft_layers is None else draft_layers
    if draft_layers not in layers:
        raise ValueError(f"generate: draft_layers={draft_layers} is not an exit of this model; its exits are "
                         f"after layers {list(layers)}")
    return draft_layers, tree


def generate_text(model, prompts: list[str], *, max_new_tokens: int, stop: str | None = None, tokenizer=None,
                  **kwargs):
    """`generate` for strings through `tokenizer` (zoo/tokenizer.py; default bytes, or the one
    zoo.hf.load returns). A row stops at `stop`, a string of one token, or else at the tokenizer's
    end-of-text token (bytes have none). Returns the texts (with `return_info`: the texts and the
    info dict)."""
    tok = tokenizer or tokenizer_lib.Bytes
    if tok.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"generate_text: the tokenizer has {tok.vocab_size} ids but the model {model.cfg.vocab_size} "
                         "(model.vocab_size)")
    stop_ids = None if stop is None else tok.encode(stop, special=False)
    if stop_ids is not None and len(stop_ids) != 1:
        raise ValueError(f"generate_text: stop={stop!r} must be a single token, got ids {stop_ids}")
    stop_token = tok.eos_id if stop is None else stop_ids[0]
    out = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=max_new_tokens,
                   stop_token=stop_token, **kwargs)
    ids, info = out if kwargs.get("return_info") else (out, None)
    texts = [tok.decode(r) for r in ids]
    return (texts, info) if info is not None else texts
