"""Batched generation: prefill and the whole decode loop under one jit, on fixed-shape state.

Prompts of different lengths are left-padded into one (B, P) batch; the padding is its own document
(segment 0, the prompt segment 1), so attention never sees it and a recurrent layer restarts from a
zero state at the prompt's first token: each row gets exactly what it gets alone. The loop is a
`lax.while_loop` that stops when every row has hit `stop_token`, a stop string (infer/stops.py: each row
carries its matcher's state) or `max_new_tokens`; one compile per (batch, padded prompt length,
max_new_tokens, sampling flags, early-exit settings, stop-string table shape). Early exit and
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

from infer import early_exit, speculative, stops
from infer.quantize import quantize as quantize_model
from kernels.attention import fresh_caches
from layers.state import hold
from zoo import tokenizer as tokenizer_lib

TRACES = {"generate": 0}  # incremented at trace time: tests check the loop compiles once


@functools.partial(jax.tree_util.register_dataclass, data_fields=["temperature", "top_p"], meta_fields=["top_k"])
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is drawn from the logits: temperature 0 is greedy; top_k / top_p keep the k most likely
    tokens / the smallest set whose probability reaches top_p (None: no cut)."""
    temperature: float | Array | None = 0.0  # `traced`'s copy: an Array, or None for greedy decoding
    top_k: int | None = None
    top_p: float | Array | None = None

    def traced(self) -> "Sampling":
        """This sampling as the jitted loops take it: temperature and top_p float32 scalars (traced, so one
        compile serves every value), None for greedy decoding and for no nucleus cut (static)."""
        return Sampling(None if self.temperature == 0 else jnp.float32(self.temperature), self.top_k,
                        None if self.top_p is None else jnp.float32(self.top_p))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["threshold"],
                   meta_fields=["measure", "decay", "level", "full_blocks"])
@dataclasses.dataclass(frozen=True)
class Exits:
    """Early exit (infer/early_exit.py): a row stops at the first exit whose confidence by `measure`
    (softmax, margin, saturation, classifier) reaches `threshold` in [0, 1], which falls along the output
    by CALM's `decay`; `level` token decides per token and row, sequence one depth per row from its prompt.
    At the token level, the layers past the exit only advance their state (no output path) at a token
    where every row of the batch has exited (batch 1: every token), and run in full at other tokens;
    `full_blocks` always runs them in full (the same tokens and states, slower: the reference). Under
    jit the threshold is traced, the rest static."""
    threshold: float | Array  # an Array in generate's jitted loop
    measure: str = "softmax"
    decay: float = 0.0
    level: str = "token"  # "token" or "sequence"
    full_blocks: bool = False


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Speculative decoding (infer/speculative.py): k draft tokens per round from `draft_model` (any model
    of the same vocabulary) or else the first `draft_layers` layers of the model and their exit (default
    the first exit), verified in one pass; `tree=(w_1, .., w_m)` (greedy only) checks w_1 ... w_m draft
    paths per round, branching into the w_i most likely draft tokens at depth i."""
    k: int
    draft_layers: int | None = None
    draft_model: nnx.Module | None = None
    tree: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Decoding with a quantized copy of the model (infer/quantize.py): `weights` int8 or int4 (in groups of
    `group_size` input rows), `kv_cache` int8 (None: left in float), `activations` int8 (W8A8 products) or
    float."""
    weights: str | None = None
    kv_cache: str | None = None
    group_size: int = 32
    activations: str = "int8"


def sample_logits(logits: Float[Array, "B V"], key, sampling: Sampling) -> Int[Array, " B"]:
    """Pick one token per row from float32 logits (B, V) by `sampling` as `Sampling.traced` gives it
    (temperature None: greedy)."""
    if sampling.temperature is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = speculative.warp(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# Decode loops carry every layer's state through a while loop. XLA on CPU copies a loop-carried buffer
# it cannot prove is read before it is updated; its region analysis proves it for the KV cache, which
# attention reads before writing (kernels/attention/__init__.py `attention_cached`): GQA at 4K slots,
# 2.0 -> 1.5 ms per token (benchmarks/decode.py). Other backends ignore the option.
DECODE_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"), compiler_options=DECODE_OPTIONS)
def _generate(graphdef, params, tokens, segment_ids, key, stop_token, stop_table, sampling: Sampling,
              exits: Exits | None, *, max_new_tokens: int):
    """(tokens (B, max_new_tokens) with -1 after the end, layers used per token, overflowed); `sampling`
    traced (`Sampling.traced`); `stop_table` the stop strings' table (`stops.StopStrings.table`) or None."""
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()  # no training-time side effects (MoE jitter, bias updates) inside the loop
    B, P = tokens.shape
    L = model.cfg.num_layers
    state = model.init_state(B, P + max_new_tokens)
    if exits is None:
        def step(last, state, i):
            logits, state = model.decode(last[:, None], state)
            return logits[:, -1], state, jnp.full((B,), L)

        with fresh_caches():
            logits, state = model.decode(tokens, state, segment_ids=segment_ids)
        logits, used = logits[:, -1], jnp.full((B,), L)
    else:
        if exits.level == "sequence":
            depth = early_exit.prompt_depth(model, tokens, segment_ids, exits.measure, exits.threshold)
            rule = lambda i: lambda j, h, h_prev, z: depth == model.exit_layers[j]
        else:
            rule = lambda i: early_exit.confident(
                model, exits.measure, early_exit.threshold_at(exits.threshold, exits.decay, i, max_new_tokens))

        def step(last, state, i):
            logits, used, state = early_exit.exit_pass(model, last[:, None], state, stop_rule=rule(i),
                                                       skip=exits.level == "sequence",
                                                       full_blocks=exits.full_blocks)
            return logits, state, used

        with fresh_caches():
            logits, used, state = early_exit.exit_pass(model, tokens, state, stop_rule=rule(0),
                                                       segment_ids=segment_ids, freeze=False)
    first = sample_logits(logits, jax.random.fold_in(key, 0), sampling)
    out = jnp.full((B, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    layers = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(used)

    def cond(carry):
        i, _, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, state, last, out, layers, done, matched = carry
        logits, state, used = step(last, state, i)
        tok = sample_logits(logits, jax.random.fold_in(key, i), sampling)
        out = jax.lax.dynamic_update_slice(out, jnp.where(done, -1, tok)[:, None], (0, i))
        layers = jax.lax.dynamic_update_slice(layers, jnp.where(done, 0, used)[:, None], (0, i))
        matched, done = stops.advance(stop_table, matched, tok[:, None], done | (tok == stop_token))
        return i + 1, state, tok, out, layers, done, matched

    matched, done = stops.advance(stop_table, None, first[:, None], first == stop_token)
    _, state, _, out, layers, _, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), state, first, out, layers, done, matched))
    return out, layers, model.overflowed(state)


@functools.partial(jax.jit, static_argnames=("graphdef", "draft_graphdef", "speculation", "max_new_tokens"),
                   compiler_options=DECODE_OPTIONS)
def _speculate(graphdef, params, draft_graphdef, draft_params, tokens, segment_ids, key, stop_token, stop_table,
               sampling: Sampling, speculation: Speculation, *, max_new_tokens: int):
    """Speculative decoding (infer/speculative.py): (tokens (B, max_new_tokens) with -1 after the end,
    accepted drafts per row, rounds per row, overflowed); `sampling` traced (`Sampling.traced`),
    `speculation` checked (`_speculation`, its draft model given as draft_graphdef and draft_params).
    Row b has produced i[b] tokens; it is active until it reaches max_new_tokens, the stop token or a stop
    string (`stop_table` as in `_generate`; matched over each round's kept tokens), and an inactive row's
    states are held."""
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()
    B, P = tokens.shape
    k, greedy = speculation.k, sampling.temperature is None
    size = P + max_new_tokens + k + 1  # an active row has fed at most max_new_tokens - 1 tokens, + k + 1 checked
    warp_fn = lambda logits: speculative.warp(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if draft_graphdef is None:
        drafter, draft_state = speculative.self_drafter(model, speculation.draft_layers, k), None
    else:
        draft = nnx.merge(draft_graphdef, draft_params)
        draft.eval()
        drafter = speculative.model_drafter(draft, k)
        with fresh_caches():
            draft_state = draft.decode(tokens, draft.init_state(B, size), segment_ids=segment_ids)[1]
    with fresh_caches():
        logits, state = model.decode(tokens, model.init_state(B, size), segment_ids=segment_ids)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), sampling)
    out = jnp.full((B, max_new_tokens + k + 1), -1, jnp.int32).at[:, 0].set(first)
    write = jax.vmap(lambda row, kept, i: jax.lax.dynamic_update_slice(row, kept, (i,)))
    zeros = jnp.zeros((B,), jnp.int32)

    def body(carry):
        r, i, state, draft_state, last, out, done, matched, accepted, rounds = carry
        kept, n, new_state, new_draft_state = speculative.speculative_round(
            model, drafter, last, state, draft_state, jax.random.fold_in(key, r + 1), k=k, tree=speculation.tree,
            warp_fn=warp_fn, greedy=greedy)
        active = ~done
        state, draft_state = hold(active, state, new_state), hold(active, draft_state, new_draft_state)
        out = write(out, jnp.where(active[:, None], kept, -1), i)
        i = i + jnp.where(active, n + 1, 0)
        matched, done = stops.advance(stop_table, matched, kept, done | jnp.any(kept == stop_token, axis=1), n + 1)
        done = done | (i >= max_new_tokens)
        last = jnp.where(active, jnp.take_along_axis(kept, n[:, None], 1)[:, 0], last)
        return (r + 1, i, state, draft_state, last, out, done, matched, accepted + jnp.where(active, n, 0),
                rounds + active)

    matched, done = stops.advance(stop_table, None, first[:, None], (first == stop_token) | (max_new_tokens == 1))
    carry = (jnp.int32(0), zeros + 1, state, draft_state, first, out, done, matched, zeros, zeros)
    _, _, state, _, _, out, _, _, accepted, rounds = jax.lax.while_loop(lambda c: ~jnp.all(c[6]), body, carry)
    return out[:, :max_new_tokens], accepted, rounds, model.overflowed(state)


def generate(model, prompts, *, max_new_tokens: int, sampling: Sampling = Sampling(), exits: Exits | None = None,
             speculation: Speculation | None = None, quantization: Quantization | None = None, seed: int = 0,
             stop_token: int | None = None, stop_strings: stops.StopStrings | None = None, return_info: bool = False):
    """New token ids for each prompt (a list of token-id lists of any lengths).

    `sampling` (default greedy) draws each token; a row ends after `stop_token` (which is not returned), at the
    token that completes one of `stop_strings` in the row's generated text (`infer.stops.build` for the model's
    vocabulary; that token is returned, as it may hold text before the match) or after `max_new_tokens`. The
    same seed gives the same tokens.

    `exits` (a model with `model.exits`) decodes with early exit, `speculation` with speculative decoding
    (greedy: exactly plain greedy decoding's tokens; sampling: exactly plain sampling's distribution); one
    of them at most. See `Exits` and `Speculation`.

    With `return_info`, also returns a dict with `exit_layers` (the layers each token used, per row)
    and, when speculating, `acceptance` (accepted drafts / drafted tokens) and `rounds` (summed over rows).

    `quantization` decodes with a quantized copy of the model (and of the draft model), made on each call
    by `infer.quantize` (infer/quantize.py, with its defaults: W8A8 products, int4 groups of 32); to decode
    many times, call `infer.quantize` once and pass its model instead.
    """
    if quantization is not None:
        how = dict(weights=quantization.weights, kv_cache=quantization.kv_cache, group_size=quantization.group_size,
                   activations=quantization.activations)
        model = quantize_model(model, **how)
        if speculation is not None and speculation.draft_model is not None:
            speculation = dataclasses.replace(speculation, draft_model=quantize_model(speculation.draft_model, **how))
    tokens, segments = _prompt_batch(model, prompts, max_new_tokens, sampling, stop_token, stop_strings)
    graphdef, params = nnx.split(model)
    args = (jnp.asarray(tokens), jnp.asarray(segments), jax.random.key(seed),
            jnp.int32(-2 if stop_token is None else stop_token),
            None if stop_strings is None else jnp.asarray(stop_strings.table), sampling.traced())
    if speculation is not None:
        if exits is not None:
            raise ValueError("generate: give exits or speculation, not both")
        draft = speculation.draft_model
        draft_graphdef, draft_params = nnx.split(draft) if draft is not None else (None, None)
        speculation = dataclasses.replace(_speculation(model, sampling, speculation), draft_model=None)  # static
        out, accepted, rounds, overflowed = _speculate(graphdef, params, draft_graphdef, draft_params, *args,
                                                       speculation, max_new_tokens=max_new_tokens)
        layers = jnp.full(out.shape, model.cfg.num_layers, jnp.int32)
    else:
        exits = exits and dataclasses.replace(_exits(model, exits), threshold=jnp.float32(exits.threshold))
        out, layers, overflowed = _generate(graphdef, params, *args, exits, max_new_tokens=max_new_tokens)
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
        n = n if stop_strings is None else stop_strings.end(row[:n])
        rows.append(row[:n])
        used.append(row_layers[:n])
    if not return_info:
        return rows
    info = {"exit_layers": used}
    if speculation is not None:
        rounds = int(np.sum(rounds))
        info.update(rounds=rounds, acceptance=int(np.sum(accepted)) / max(rounds * speculation.k, 1))
    return rows, info


def check_request(prompts, max_new_tokens: int, sampling: Sampling, stop_token, stop_strings, vocab_size: int,
                  where: str):
    """A ValueError, its message starting with `where`, unless every prompt is a non-empty list of token ids of
    the vocabulary, max_new_tokens >= 1, the sampling settings are in range, stop_token is a token id and the
    stop strings were built for this vocabulary (`generate` and infer.Engine.submit check alike)."""
    V = vocab_size
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"{where}: every prompt needs at least one token (e.g. a newline byte)")
    if max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {max_new_tokens}")
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    if temperature < 0 or (top_k is not None and not 1 <= top_k <= V) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"{where}: need temperature >= 0, 1 <= top_k <= {V} (the vocabulary), 0 < top_p <= 1; "
                         f"got temperature={temperature}, top_k={top_k}, top_p={top_p}")
    bad = [(i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < V]
    if bad:
        raise ValueError(f"{where}: token ids must be in [0, {V}) (model.vocab_size); prompt {bad[0][0]} holds "
                         f"{bad[0][1]}")
    if stop_token is not None and not 0 <= stop_token < V:
        raise ValueError(f"{where}: stop_token={stop_token} is not a token id in [0, {V})")
    if stop_strings is not None and stop_strings.table.shape[1] != V:
        raise ValueError(f"{where}: stop_strings were built for {stop_strings.table.shape[1]} token ids, the model "
                         f"has {V} (model.vocab_size); build them from a token_bytes() of that length")


def _prompt_batch(model, prompts, max_new_tokens: int, sampling: Sampling, stop_token,
                  stop_strings) -> tuple[np.ndarray, ...]:
    """Check the prompts, the sampling and the stop arguments; returns the left-padded (tokens, segment_ids),
    (B, P) each."""
    check_request(prompts, max_new_tokens, sampling, stop_token, stop_strings, model.cfg.vocab_size, "generate")
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    segments = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = p
        segments[i, P - len(p):] = 1
    return tokens, segments


def _exits(model, exits: Exits) -> Exits:
    """Check the early-exit arguments against the model."""
    if not getattr(model, "exit_layers", ()):
        raise ValueError("generate: early exit needs a model with exits (model.exits in its config, e.g. "
                         "configs/early_exit.yaml)")
    if not 0 <= exits.threshold <= 1:
        raise ValueError(f"generate: exit_threshold must be in [0, 1], got {exits.threshold}")
    measure, level, decay = exits.measure, exits.level, exits.decay
    if measure not in early_exit.MEASURES or level not in ("token", "sequence") or decay < 0:
        raise ValueError(f"generate: exit_measure must be one of {', '.join(early_exit.MEASURES)}, exit_level "
                         f"token or sequence, exit_decay >= 0; got {measure!r}, {level!r}, {decay}")
    return dataclasses.replace(exits, decay=float(decay))


def _speculation(model, sampling: Sampling, speculation: Speculation) -> Speculation:
    """Check the speculative-decoding arguments; returns them as `_speculate` takes them: the draft layers
    chosen (None with a draft model) and the tree a tuple."""
    k, draft_layers, draft_model = speculation.k, speculation.draft_layers, speculation.draft_model
    if k < 1:
        raise ValueError(f"generate: speculation needs k >= 1 draft tokens, got {k}")
    tree = tuple(speculation.tree or ())
    if tree and (sampling.temperature != 0 or any(w < 1 for w in tree) or len(tree) > k):
        raise ValueError(f"generate: tree={tree} needs greedy decoding (temperature 0), branching factors >= 1 "
                         f"and at most k={k} levels")
    if draft_model is not None:
        if draft_layers is not None:
            raise ValueError("generate: give draft_model or draft_layers (self-speculation), not both")
        if draft_model.cfg.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"generate: the draft model's vocabulary ({draft_model.cfg.vocab_size}, model.vocab_size) "
                             f"differs from the target's ({model.cfg.vocab_size}); both need one tokenizer")
        return dataclasses.replace(speculation, tree=tree)
    layers = getattr(model, "exit_layers", ())
    if not layers:
        raise ValueError("generate: speculative decoding needs a draft_model, or a model with exits (model.exits "
                         "in its config, e.g. configs/early_exit.yaml) to draft with its first layers")
    draft_layers = layers[0] if draft_layers is None else draft_layers
    if draft_layers not in layers:
        raise ValueError(f"generate: draft_layers={draft_layers} is not an exit of this model; its exits are "
                         f"after layers {list(layers)}")
    return dataclasses.replace(speculation, draft_layers=draft_layers, tree=tree)


def generate_text(model, prompts: list[str], *, max_new_tokens: int, stop: str | list[str] | None = None,
                  tokenizer=None, **kwargs):
    """`generate` for strings through `tokenizer` (zoo/tokenizer.py; default bytes, or the one
    zoo.hf.load returns). A row stops at the tokenizer's end-of-text token (bytes have none) or at any
    of the `stop` strings (one or a list, of any length) in its generated text, which is cut before the
    earliest of them. Returns the texts (with `return_info`: the texts and the info dict)."""
    tok = tokenizer or tokenizer_lib.Bytes
    V = model.cfg.vocab_size
    if tok.vocab_size > V:
        raise ValueError(f"generate_text: the tokenizer has {tok.vocab_size} ids but the model {V} (model.vocab_size)")
    stop_strings = None if stop is None else stops.for_tokenizer(tok, stops.checked(stop), V)
    out = generate(model, [tok.encode(p) for p in prompts], max_new_tokens=max_new_tokens,
                   stop_token=tok.eos_id, stop_strings=stop_strings, **kwargs)
    ids, info = out if kwargs.get("return_info") else (out, None)
    texts = [tok.decode(r) if stop is None else stop_strings.cut(tok.decode(r)) for r in ids]
    return (texts, info) if info is not None else texts
