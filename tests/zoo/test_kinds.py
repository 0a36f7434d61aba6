"""Every registered mixer kind inside LanguageModel: modes agree, decode equals the full pass,
packed rows equal their documents alone, and a recurrent state does not grow with max_len."""

import typing

import jax
import jax.numpy as jnp
import pytest

from tests.util import assert_close, decode_in_pieces, forward, packed_equals_alone, tiny_model
from zoo.registry import MIXERS

# Small instances of each kind; chunk_size 4 so that T = 13 spans several ragged chunks.
TINY = {
    "rwkv6": {"kind": "rwkv6", "head_dim": 16, "mix_lora_dim": 4, "decay_lora_dim": 4, "chunk_size": 4},
    "rwkv7": {"kind": "rwkv7", "head_dim": 16, "chunk_size": 4},
    "mamba": {"kind": "mamba", "state_size": 4, "chunk_size": 4},
    "mamba2": {"kind": "mamba2", "state_size": 8, "head_dim": 16, "chunk_size": 4},
    "linear_attention": {"kind": "linear_attention", "num_heads": 2, "feature_map": "hedgehog", "chunk_size": 4},
    "retnet": {"kind": "retnet", "num_heads": 2, "chunk_size": 4},
    "gla": {"kind": "gla", "num_heads": 2, "conv_size": 4, "chunk_size": 4},
    "deltanet": {"kind": "deltanet", "num_heads": 2, "chunk_size": 4},
    "gated_deltanet": {"kind": "gated_deltanet", "num_heads": 2, "chunk_size": 4},
}
RECURRENT = [k for k in TINY]


def test_every_registered_kind_is_covered():
    assert set(MIXERS) - {"attention"} == set(TINY)


def _modes(kind):
    hints = typing.get_type_hints(MIXERS[kind])
    return typing.get_args(hints["mode"]) if "mode" in hints else ()


FFN = {"rwkv6": {"kind": "rwkv6_channel_mix"}, "rwkv7": {"kind": "rwkv7_channel_mix"}}


def model_of(kind, **mixer):
    return tiny_model({**TINY[kind], **mixer}, ffn=FFN.get(kind, {"kind": "mlp"}))


@pytest.mark.parametrize("kind", TINY)
def test_modes_give_the_same_logits(kind):
    tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, 256)
    logits = {m: forward(model_of(kind, mode=m), tokens) for m in _modes(kind)}
    assert len(logits) >= 2
    ref = logits.pop("recurrent")
    for mode, out in logits.items():
        assert_close(out, ref, 1e-4, f"{kind} mode={mode} vs recurrent")


@pytest.mark.parametrize("kind", TINY)
def test_prefill_then_token_by_token_equals_full_pass(kind):
    model = model_of(kind)
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, 256)
    pieces, _ = decode_in_pieces(model, tokens, cuts=[7, 8, 9, 10, 11, 12])
    assert float(jnp.abs(pieces - forward(model, tokens)).max()) <= 1e-4


@pytest.mark.parametrize("kind", TINY)
def test_packed_batch_equals_documents_alone(kind):
    packed_equals_alone(model_of(kind), [5, 1, 7, 3])


@pytest.mark.parametrize("kind", RECURRENT)
def test_state_does_not_grow_with_max_len(kind):
    model = model_of(kind)
    small = jax.eval_shape(lambda: model.init_state(1, 128))
    large = jax.eval_shape(lambda: model.init_state(1, 16384))
    assert jax.tree.map(lambda x: x.shape, small) == jax.tree.map(lambda x: x.shape, large)


def test_hybrid_layer_pattern_decodes_and_packs():
    pattern = [TINY["mamba"], {"kind": "attention", "num_heads": 2, "num_kv_heads": 1}]
    model = tiny_model(layer_pattern=pattern, num_layers=4)
    assert [type(b.mixer).__name__ for b in model.blocks] == ["Mamba", "Attention", "Mamba", "Attention"]
    tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, 256)
    pieces, _ = decode_in_pieces(model, tokens, cuts=[7, 8, 9, 10, 11, 12])
    assert float(jnp.abs(pieces - forward(model, tokens)).max()) <= 1e-4
    packed_equals_alone(model, [5, 1, 7])
