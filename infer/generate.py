"""Batched generation: prefill and the whole decode loop under one jit, on fixed-shape state.

Prompts of different lengths are left-padded into one (B, P) batch; the padding is its own document
(segment 0, the prompt segment 1), so attention never sees it and a recurrent layer restarts from a
zero state at the prompt's first token: each row gets exactly what it gets alone. The loop is a
`lax.while_loop` that stops when every row has hit `stop_token` or `max_new_tokens`; one compile per
(batch, padded prompt length, max_new_tokens, sampling flags, early-exit settings). Early exit and
self-speculative decoding (infer/early_exit.py) run inside the same loop. A model whose parameters
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

from infer import early_exit
from infer.quantize import quantize as quantize_model
from zoo import tokenizer as tokenizer_lib

TRACES = {"generate": 0}  # incremented at trace time: tests check the loop compiles once


def sample_logits(logits: Float[Array, "B V"], key, temperature, top_k: int | None, top_p, greedy: bool
                  ) -> Int[Array, " B"]:
    """Pick one token per row from float32 logits (B, V); temperature and top_p are scalars (traced),
    top_p None for no nucleus cut."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before it < top_p.
        keep = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Exits:
    """How `_generate` exits early (static under jit): see infer/early_exit.py."""
    measure: str = "softmax"
    level: str = "token"  # "token" or "sequence"
    decay: float = 0.0
    speculative: int = 0  # draft length k; 0 = off
    draft: int = 0  # layers of the draft model


# Decode loops carry every layer's state through a while loop. XLA on CPU copies a loop-carried buffer
# it cannot prove is read before it is updated; its region analysis proves it for the KV cache, which
# attention reads before writing (kernels/attention/__init__.py `attention_cached`): GQA at 4K slots,
# 2.0 -> 1.5 ms per token (benchmarks/decode.py). Other backends ignore the option.
DECODE_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "greedy", "use_top_p", "exits"),
                   compiler_options=DECODE_OPTIONS)
def _generate(graphdef, params, tokens, segment_ids, key, temperature, top_p, stop_token, threshold, *,
              max_new_tokens: int, top_k, greedy: bool, use_top_p: bool, exits: Exits | None):
    """(tokens (B, max_new_tokens) with -1 after the end, layers used per token, accepted drafts, rounds)."""
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()  # no training-time side effects (MoE jitter, bias updates) inside the loop
    B, P = tokens.shape
    L = len(model.blocks)
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k,
                               top_p=top_p if use_top_p else None, greedy=greedy)
    k = exits.speculative if exits else 0
    state = model.init_state(B, P + max_new_tokens + k)
    if exits is None or k:
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
                                                       skip=exits.level == "sequence")
            return logits, state, used

        logits, used, state = early_exit.exit_pass(model, tokens, state, stop_rule=rule(0), segment_ids=segment_ids,
                                                   freeze=False)
    first = sample(logits, jax.random.fold_in(key, 0))
    out = jnp.full((B, max_new_tokens + k), -1, jnp.int32).at[:, 0].set(first)
    layers = jnp.zeros((B, max_new_tokens + k), jnp.int32).at[:, 0].set(used)

    def cond(carry):
        i, _, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, state, last, out, layers, done, accepted = carry
        if k:  # kept: the n + 1 tokens of this round, -1 after them
            kept, n, state = early_exit.speculative_round(model, last, state, ~done, k=k, draft=exits.draft)
            kept = jnp.where(jnp.arange(k + 1) <= n, kept, -1)
            tok, count, accepted = kept[:, n], n + 1, accepted + n
            used = jnp.where(kept >= 0, L, 0)
        else:
            logits, state, used = step(last, state, i)
            tok = sample(logits, jax.random.fold_in(key, i))
            kept, count, used = tok[:, None], 1, used[:, None]
        kept = jnp.where(done[:, None], -1, kept)
        out = jax.lax.dynamic_update_slice(out, kept, (0, i))
        layers = jax.lax.dynamic_update_slice(layers, jnp.where(done[:, None], 0, used), (0, i))
        return i + count, state, tok, out, layers, done | jnp.any(kept == stop_token, axis=1), accepted

    done = first == stop_token
    i, state, _, out, layers, _, accepted = jax.lax.while_loop(
        cond, body, (jnp.int32(1), state, first, out, layers, done, jnp.int32(0)))
    valid = jnp.arange(max_new_tokens) < i
    return (jnp.where(valid, out[:, :max_new_tokens], -1), layers[:, :max_new_tokens], accepted, i,
            model.overflowed(state))


def generate(model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, stop_token: int | None = None,
             exit_threshold: float | None = None, exit_measure: str = "softmax", exit_decay: float = 0.0,
             exit_level: str = "token", speculative: int | None = None, draft_layers: int | None = None,
             quantize: str | None = None, kv_cache: str | None = None, return_info: bool = False):
    """New token ids for each prompt (a list of token-id lists of any lengths).

    temperature 0 is greedy; top_k / top_p restrict sampling; a row ends after `stop_token` (which is
    not returned) or `max_new_tokens`. The same seed gives the same tokens.

    Early exit (a model with `model.exits`, see infer/early_exit.py): `exit_threshold` in [0, 1] turns it
    on, with `exit_measure` (softmax, margin, saturation, classifier), `exit_decay` (CALM's threshold
    decay along the output) and `exit_level` (token: decided per token and row; sequence: one depth per
    row, chosen from its prompt). `speculative=k` drafts k tokens with the first `draft_layers` layers
    (an exit layer; default the first) and verifies them with the full model: greedy only, and the
    tokens are exactly plain greedy decoding's. With `return_info`, also returns a dict with
    `exit_layers` (the layers each token used, per row) and, when speculating, `acceptance` (accepted
    drafts / drafted tokens) and `rounds`.

    `quantize` ("int8" or "int4") and `kv_cache` ("int8") decode with a quantized copy of the model,
    made on each call by `infer.quantize` (infer/quantize.py, with its defaults: W8A8 products, int4
    groups of 32); to decode many times, call `infer.quantize` once and pass its model instead.
    """
    if quantize is not None or kv_cache is not None:
        model = quantize_model(model, weights=quantize, kv_cache=kv_cache)
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
    exits = _exits(model, temperature, exit_threshold, exit_measure, exit_decay, exit_level, speculative, draft_layers)
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    segments = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = p
        segments[i, P - len(p):] = 1
    graphdef, params = nnx.split(model)
    out, layers, accepted, count, overflowed = _generate(
        graphdef, params, jnp.asarray(tokens), jnp.asarray(segments), jax.random.key(seed),
        jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p or 1.0),
        jnp.int32(-2 if stop_token is None else stop_token),
        jnp.float32(1.0 if exit_threshold is None else exit_threshold), max_new_tokens=max_new_tokens, top_k=top_k,
        greedy=temperature == 0, use_top_p=top_p is not None, exits=exits)
    if not out.is_fully_addressable:  # params spread over several processes: every one gets all of it
        out, layers, accepted, count, overflowed = multihost_utils.process_allgather(
            (out, layers, accepted, count, overflowed), tiled=True)
    if np.any(overflowed):  # the cache is sized for prompt + max_new_tokens (+ k drafts): a bug, never silent
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
        rounds = int(count) - 1 - int(accepted)  # each round keeps its accepted drafts + 1 token
        info.update(rounds=rounds, acceptance=int(accepted) / max(rounds * speculative, 1))
    return rows, info


def _exits(model, temperature, threshold, measure, decay, level, speculative, draft) -> Exits | None:
    """Check the early-exit arguments against the model; None when neither exits nor speculation is on."""
    if threshold is None and not speculative:
        return None
    layers = getattr(model, "exit_layers", ())
    if not layers:
        raise ValueError("generate: early exit and self-speculative decoding need a model with exits "
                         "(model.exits in its config, e.g. configs/early_exit.yaml)")
    if threshold is not None and speculative:
        raise ValueError("generate: give exit_threshold or speculative, not both")
    if threshold is not None and not 0 <= threshold <= 1:
        raise ValueError(f"generate: exit_threshold must be in [0, 1], got {threshold}")
    if measure not in early_exit.MEASURES or level not in ("token", "sequence") or decay < 0:
        raise ValueError(f"generate: exit_measure must be one of {', '.join(early_exit.MEASURES)}, exit_level "
                         f"token or sequence, exit_decay >= 0; got {measure!r}, {level!r}, {decay}")
    if speculative is not None and (speculative < 1 or temperature != 0):
        raise ValueError(f"generate: speculative=k needs k >= 1 and greedy decoding (temperature 0); "
                         f"got k={speculative}, temperature={temperature}")
    draft = layers[0] if draft is None else draft
    if speculative and draft not in layers:
        raise ValueError(f"generate: draft_layers={draft} is not an exit of this model; its exits are "
                         f"after layers {list(layers)}")
    return Exits(measure=measure, level=level, decay=float(decay), speculative=speculative or 0, draft=draft)


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
