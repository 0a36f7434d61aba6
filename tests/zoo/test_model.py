"""LanguageModel itself: causality, prompts of different lengths in one batch, an untied head,
bfloat16 compute, and rolling a decode state back per row (speculative decoding). Decoding and
packing of every shipped config: test_kinds.py; every mixer's own protocol:
tests/layers/test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.layers.conformance import perturbed
from tests.util import assert_close, decode_in_pieces, forward, tiny_model

ATTENTION_VARIANTS = {
    "mha": {"kind": "attention", "num_heads": 4},
    "gqa": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
    "mqa": {"kind": "attention", "num_heads": 4, "num_kv_heads": 1},
    "window": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2, "window": 5},
}


def test_causality():
    model = tiny_model()
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 256)
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :9]), np.asarray(b[:, :9]))
    assert not np.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("variant", ["mha", "window"])
def test_prompts_of_different_lengths_in_one_batch(variant):
    """Left-padded rows (padding as its own document) decode as each prompt alone."""
    model = tiny_model(ATTENTION_VARIANTS[variant])
    lengths, T = [9, 4, 6], 9
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n) for n in lengths]
    tokens = np.zeros((3, T), np.int32)
    seg = np.zeros((3, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, T - len(p):], seg[i, T - len(p):] = p, 1
    cont = rng.integers(1, 256, (3, 4))
    batch, _ = decode_in_pieces(model, jnp.asarray(np.concatenate([tokens, cont], 1)), cuts=[T, T + 1, T + 2, T + 3],
                                segment_ids=jnp.asarray(np.concatenate([seg, np.ones((3, 4), np.int32)], 1)))
    # Each prompt alone, right-padded into one batch (causality keeps the padding out of the logits).
    alone = forward(model, jnp.asarray(np.stack([np.pad(np.concatenate([p, cont[i]]), (0, T - len(p)))
                                                 for i, p in enumerate(prompts)])))
    for i, p in enumerate(prompts):
        assert float(jnp.abs(batch[i, T - len(p):] - alone[i, :len(p) + 4]).max()) <= 1e-4


def test_untied_head_and_bfloat16_compute():
    untied = tiny_model(tie_embeddings=False)
    assert untied.head is not None
    tokens = jax.random.randint(jax.random.key(2), (1, 8), 0, 256)
    bf16 = tiny_model(dtype="bfloat16")
    logits = forward(bf16, tokens)
    assert logits.dtype == jnp.float32 and bf16.embed.embedding[...].dtype == jnp.float32
    assert_close(logits, forward(tiny_model(), tokens), 5e-2, "bf16 vs f32")


@pytest.mark.parametrize("model_kw", [
    {"layer_pattern": [{"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
                       {"kind": "gated_deltanet", "num_heads": 2, "head_dim": 8}]},
    {"mixer": {"kind": "rwkv7", "head_dim": 16}, "ffn": {"kind": "rwkv7_channel_mix"}},  # v_first, a stateful FFN
    {"num_layers": 3, "ffn_pattern": [{"kind": "mlp"}, {"kind": "moe", "num_experts": 4, "dispatch": "dropless"},
                                      {"kind": "none"}]},  # an FFN per layer
], ids=["attention+gated_deltanet", "rwkv7", "ffn_pattern"])
def test_rollback_continues_as_the_kept_tokens(model_kw):
    """A verify chunk of K tokens decoded with steps=True (the logits of a plain decode), rolled back
    by a different number of tokens per row, goes on as if each row had decoded only the tokens it
    keeps: the next tokens of each row give the full pass's logits at their positions."""
    P, K, drop = 6, 4, np.array([1, 3], np.int32)
    model = perturbed(tiny_model(**model_kw))
    tokens = jax.random.randint(jax.random.key(3), (2, P + K + 2), 0, 256)
    kept = P + K - drop  # (B,) tokens each row keeps
    after = jnp.asarray(np.asarray(tokens)[np.arange(2)[:, None], kept[:, None] + np.arange(2)])  # (B, 2)

    @nnx.jit
    def run(model, tokens, after, drop):
        _, state = model.decode(tokens[:, :P], model.init_state(2, P + K + 2))
        plain, _ = model.decode(tokens[:, P:P + K], state)
        logits, stepped = model.decode(tokens[:, P:P + K], state, steps=True)
        return plain, logits, model.decode(after, model.rollback(stepped, drop))[0]

    plain, logits, then = run(model, tokens, after, jnp.asarray(drop))
    full = np.asarray(forward(model, tokens))
    assert_close(logits, plain, 1e-4, "steps=True vs plain decode")
    assert_close(logits, full[:, P:P + K], 1e-4, "steps=True vs full pass")
    assert_close(then, full[np.arange(2)[:, None], kept[:, None] + np.arange(2)], 1e-4, "after rollback")


def test_embed_scale_and_logit_softcap():
    """model.embed_scale multiplies the embeddings entering block 0; model.logit_softcap turns the final and
    every exit's logits into cap tanh(logits / cap) (Gemma's, RecurrentGemma's)."""
    exits = {"layers": [1], "weights": [1.0]}
    plain = tiny_model(exits=exits)
    plain.embed.embedding[...] = plain.embed.embedding[...] * 100  # logits well past the cap: tied head of std 2
    gemma = tiny_model(exits=exits, embed_scale=2.5, logit_softcap=3.0)
    nnx.update(gemma, nnx.state(plain))
    tokens = jnp.asarray([[3, 1, 4, 1, 5]])
    assert_close(gemma.embed_tokens(tokens), 2.5 * plain.embed_tokens(tokens), 1e-6, "embed_scale")
    x = jax.random.normal(jax.random.key(4), (1, 5, 32)) * 4
    cap = lambda logits: 3.0 * np.tanh(np.asarray(logits) / 3.0)
    assert_close(gemma.logits(x), cap(plain.logits(x)), 1e-5, "final logits")
    assert_close(gemma.exit_logits(0, x), cap(plain.exit_logits(0, x)), 1e-5, "exit logits")
    assert np.abs(np.asarray(gemma.logits(x))).max() < 3.0 < np.abs(np.asarray(plain.logits(x))).max()
