"""Every shipped config (configs/*.yaml) as shipped, but as shallow as shows every layer of it (one
layer; two for RWKV-7, whose value residual crosses layers; a layer_pattern's length; the early-exit
config keeps its four, one per exit), built fresh (flax modules start in training mode): prefill +
token-by-token decode equals the full pass of an evaluation view, whatever the mode (decoding is
inference), in infer.generate's layout, prompts of different lengths left-padded with segment 0 and
each row compared with its prompt alone (the shorter prompt is shorter than a convolution's window,
which so starts decoding over padding), decoding on from the prefill's state saved to the host and
restored; and a packed row equals its documents alone. MoE configs included: outside training their
FFN is dropless, one function of each token whatever the batch (layers/moe.py). Every kind's own
protocol runs in tests/layers/test_conformance.py; this is the model around them. Zero-initialised
weights (RWKV's output projections) get noise, so no check is vacuous."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.layers.conformance import perturbed
from tests.util import assert_close
from zoo import LanguageModel, load_config

CONFIGS = sorted(Path(__file__).parents[2].glob("configs/*.yaml"))
T, PREFILL, PAD = 13, 7, 5  # row 1's prompt: the PREFILL - PAD tokens after PAD tokens of padding
DOCS = (5, 1, 7)  # a packed row of three documents, one of a single token
SEG = jnp.asarray([[1] * PREFILL, [0] * PAD + [1] * (PREFILL - PAD)], jnp.int32)  # generate's left padding


def outputs(model, tokens, packed, alone):
    """(each row's full pass alone, prefill + steps, packed row, documents alone); the passes in evaluation
    mode, as one batch (each row a document of its own, but the packed one), the decoding in the model's
    own, on from the prefill's state saved to the host and restored."""
    @nnx.jit
    def prefill_and_passes(model, tokens, packed, alone):
        evaluated = nnx.view(model, deterministic=True)
        rows_alone = jnp.stack([tokens[0], jnp.roll(tokens[1], -PAD)])  # row 1 after its padding, then that padding
        alone = jnp.pad(alone, ((0, 0), (0, T - alone.shape[1])), constant_values=1)  # causal: the tail is unread
        seg = jnp.concatenate([jnp.zeros((2, T), jnp.int32),
                               jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in enumerate(DOCS)])[None],
                               jnp.zeros((len(DOCS), T), jnp.int32)])
        passes = evaluated(jnp.concatenate([rows_alone, packed, alone]), segment_ids=seg)  # (2 + 1 + 3, T, V)
        prefill = model.decode(tokens[:, :PREFILL], model.init_state(tokens.shape[0], T), segment_ids=SEG)
        return passes[:2], prefill, passes[2:3], passes[3:]

    @nnx.jit
    def decode_steps(model, state, tokens):
        def step(state, tok):
            out, state = model.decode(tok[:, None], state)
            return state, out[:, 0]

        return jnp.swapaxes(jax.lax.scan(step, state, tokens.T)[1], 0, 1)

    full, (logits, state), packed_out, alone_out = prefill_and_passes(model, tokens, packed, alone)
    restored = jax.tree.map(jnp.asarray, jax.device_get(state))  # numpy on the host, as a checkpoint holds it
    steps = decode_steps(model, restored, tokens[:, PREFILL:])
    return full, jnp.concatenate([logits, steps], axis=1), packed_out, alone_out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_decodes_and_packs_like_its_full_pass(path):
    shipped = load_config(path).model
    depth = len(shipped.layer_pattern or ()) or (2 if shipped.mixer.KIND == "rwkv7" else 1)
    cfg = load_config(path, [] if shipped.exits else [f"model.num_layers={depth}"])
    model = perturbed(LanguageModel(cfg.model, rngs=nnx.Rngs(0)))  # in training mode, as built
    rng = np.random.default_rng(0)
    V = cfg.model.vocab_size  # 256 bytes, or a task's vocabulary (configs/recall.yaml)
    tokens = jnp.asarray(rng.integers(0, V, (2, T)), jnp.int32)
    packed = jnp.asarray(rng.integers(0, V, (1, sum(DOCS))), jnp.int32)
    starts = np.cumsum((0, *DOCS[:-1]))
    alone = jnp.stack([jnp.pad(packed[0, s:s + n], (0, max(DOCS) - n), constant_values=1)
                       for s, n in zip(starts, DOCS, strict=True)])
    full, decoded, packed_out, alone_out = outputs(model, tokens, packed, alone)
    err = max(float(jnp.abs(decoded[0] - full[0]).max()), float(jnp.abs(decoded[1, PAD:] - full[1, :T - PAD]).max()))
    assert err <= 1e-4, f"{path.stem}: left-padded prefill + decode vs each prompt's full pass alone"
    alone_out = jnp.concatenate([alone_out[i, :n] for i, n in enumerate(DOCS)])[None]
    assert_close(packed_out, alone_out, 1e-4, f"{path.stem}: packed vs alone")
