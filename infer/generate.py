"""Batched generation: prefill and the whole decode loop under one jit, on fixed-shape state.

Prompts of different lengths are left-padded into one (B, P) batch; the padding is its own document
(segment 0, the prompt segment 1), so attention never sees it and a recurrent layer restarts from a
zero state at the prompt's first token: each row gets exactly what it gets alone. The loop is a
`lax.while_loop` that stops when every row has hit `stop_token` or `max_new_tokens`; one compile per
(batch, padded prompt length, max_new_tokens, sampling flags). A model whose parameters are sharded
over a device mesh (zoo/sharding.py) decodes the same way: jit partitions prefill and loop from the
parameters' shardings, and the tokens are those of one device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from zoo import tokenizer

TRACES = {"generate": 0}  # incremented at trace time: tests check the loop compiles once


def sample_logits(logits, key, temperature, top_k: int | None, top_p: float | None, greedy: bool):
    """Pick one token per row from float32 logits (B, V)."""
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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "greedy", "use_top_p"))
def _generate(graphdef, params, tokens, segment_ids, key, temperature, top_p, stop_token, *,
              max_new_tokens: int, top_k, greedy: bool, use_top_p: bool):
    TRACES["generate"] += 1
    model = nnx.merge(graphdef, params)
    model.eval()  # no training-time side effects (MoE jitter, bias updates) inside the loop
    B, P = tokens.shape
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k,
                               top_p=top_p if use_top_p else None, greedy=greedy)
    logits, state = model.decode(tokens, model.init_state(B, P + max_new_tokens), segment_ids=segment_ids)
    first = sample(logits[:, -1], jax.random.fold_in(key, 0))
    out = jnp.full((B, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, state, last, out, done = carry
        logits, state = model.decode(last[:, None], state)
        tok = sample(logits[:, -1], jax.random.fold_in(key, i))
        tok = jnp.where(done, -1, tok)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
        return i + 1, state, tok, out, done | (tok == stop_token)

    done = first == stop_token
    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), state, first, out, done))
    return out


def generate(model, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, stop_token: int | None = None) -> list[list[int]]:
    """New token ids for each prompt (a list of token-id lists of any lengths).

    temperature 0 is greedy; top_k / top_p restrict sampling; a row ends after `stop_token` (which is
    not returned) or `max_new_tokens`. The same seed gives the same tokens.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token (e.g. a newline byte)")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"generate: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got "
                         f"{temperature}, {top_k}, {top_p}")
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    segments = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = p
        segments[i, P - len(p):] = 1
    graphdef, params = nnx.split(model)
    out = _generate(graphdef, params, jnp.asarray(tokens), jnp.asarray(segments), jax.random.key(seed),
                    jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p or 1.0),
                    jnp.int32(-2 if stop_token is None else stop_token), max_new_tokens=max_new_tokens,
                    top_k=top_k, greedy=temperature == 0, use_top_p=top_p is not None)
    if not out.is_fully_addressable:  # params spread over several processes: every one gets all rows
        out = multihost_utils.process_allgather(out, tiled=True)
    rows = []
    for row in np.asarray(out).tolist():
        row = [t for t in row if t >= 0]
        rows.append(row[:row.index(stop_token)] if stop_token in row else row)
    return rows


def generate_text(model, prompts: list[str], *, max_new_tokens: int, stop: str | None = None, **kwargs) -> list[str]:
    """`generate` for strings through the byte tokenizer; `stop` is a single-byte stop character."""
    stop_token = None if stop is None else tokenizer.encode(stop)[0]
    ids = generate(model, [tokenizer.encode(p) for p in prompts], max_new_tokens=max_new_tokens,
                   stop_token=stop_token, **kwargs)
    return [tokenizer.decode(r) for r in ids]
