import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer import Exits
from infer.early_exit import MEASURES, confident, exit_pass
from tests.layers.conformance import perturbed
from tests.util import assert_tree_close, tiny_config
from zoo import LanguageModel
from zoo.config import from_dict

# Three rows of two lengths, 8 new tokens: most generate calls of this file are one of a few compiled programs
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41, 42, 43, 44]]
EXITS = {"layers": [1, 2], "weights": [0.5, 0.5]}


def exit_model(mixer=None, scale_last=None, **exits):
    """A 3-layer model with exits after layers 1 and 2. scale_last multiplies the last block's
    parameters, so the exits agree with the full model often but not always (a random model's exits
    almost never agree, which would leave speculation's accept path untested)."""
    model = LanguageModel(tiny_config(mixer, num_layers=3, exits={**EXITS, **exits}), rngs=nnx.Rngs(0))
    if scale_last is not None:
        last = nnx.state(model.blocks[2], nnx.Param)
        nnx.update(model.blocks[2], jax.tree.map(lambda p: p * scale_last, last))
    return model


@pytest.fixture(scope="module")
def model():
    return exit_model()


def test_threshold_one_is_the_full_model_and_zero_the_first_exit(model):
    greedy = infer.generate(model, PROMPTS, max_new_tokens=8)
    for measure in MEASURES:
        full, info = infer.generate(model, PROMPTS, max_new_tokens=8, exits=Exits(1.0, measure=measure),
                                    return_info=True)
        assert full == greedy and {x for r in info["exit_layers"] for x in r} == {3}, measure
        first, info = infer.generate(model, PROMPTS, max_new_tokens=8, exits=Exits(0.0, measure=measure),
                                     return_info=True)
        assert {x for r in info["exit_layers"] for x in r} == {1}, measure
    for threshold, layer in ((1.0, 3), (0.0, 1)):
        out, info = infer.generate(model, PROMPTS, max_new_tokens=8, exits=Exits(threshold, level="sequence"),
                                   return_info=True)
        assert {x for r in info["exit_layers"] for x in r} == {layer}
        assert (out == greedy) == (layer == 3)


def test_first_exit_tokens_follow_the_exit_head(model):
    """At threshold 0 the first token is exit 1's greedy token after the prompt. (Any measure stops every
    row at the first exit at threshold 0; saturation and 8 tokens are the next test's compiled program.)"""
    out = infer.generate(model, [PROMPTS[1]], max_new_tokens=8, exits=Exits(0.0, measure="saturation"))
    logits = nnx.jit(lambda m, t: m.exit_logits(0, m(t, return_exits=True)[1][0]))(model, jnp.asarray([PROMPTS[1]]))
    assert out[0][0] == int(jnp.argmax(logits[0, -1]))


def test_rows_exiting_at_different_layers_each_get_their_tokens_alone(model):
    prompts = PROMPTS  # the batch is the first test's saturation program; alone, two lengths: two programs
    for threshold in (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99):
        batch, info = infer.generate(model, prompts, max_new_tokens=8, exits=Exits(threshold, measure="saturation"),
                                     return_info=True)
        if len({tuple(r) for r in info["exit_layers"]}) > 1 and len({x for r in info["exit_layers"] for x in r}) > 1:
            break
    else:
        pytest.fail("no threshold made the rows exit at different layers")
    for prompt, tokens, layers in zip(prompts, batch, info["exit_layers"]):
        alone, alone_info = infer.generate(model, [prompt], max_new_tokens=8,
                                           exits=Exits(threshold, measure="saturation"), return_info=True)
        assert alone == [tokens] and alone_info["exit_layers"] == [layers]


@functools.partial(nnx.jit, static_argnames=("steps", "full_blocks"))
def exit_decode(model, prompt, threshold, *, steps: int, full_blocks: bool):
    """Greedy token-level exit decoding (saturation measure) of `steps` tokens after `prompt` (B, P):
    the tokens (B, steps), the layers each used (B, steps) and the state after them."""
    rule = confident(model, "saturation", threshold)
    state = model.init_state(prompt.shape[0], prompt.shape[1] + steps)
    logits, _, state = exit_pass(model, prompt, state, stop_rule=rule, freeze=False)

    def step(carry, _):
        tok, state = carry
        logits, used, state = exit_pass(model, tok[:, None], state, stop_rule=rule, full_blocks=full_blocks)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return (nxt, state), (nxt, used)

    (_, state), (tokens, used) = jax.lax.scan(step, (jnp.argmax(logits, -1).astype(jnp.int32), state), None,
                                              length=steps)
    return tokens.T, used.T, state


@pytest.mark.parametrize("mixer, ffn", [({"kind": "attention", "num_heads": 4, "num_kv_heads": 2}, "mlp"),
                                        ({"kind": "mamba"}, "none"),
                                        ({"kind": "rwkv7", "head_dim": 16}, "rwkv7_channel_mix")],
                         ids=["gqa", "mamba", "rwkv7"])
def test_skipped_layers_advancing_only_their_state_equal_running_in_full(mixer, ffn):
    """Past the layer every row exited at, a block only advances its state: the same tokens, exit layers and
    states as running it in full, in a batch whose rows exit at different layers and alone."""
    model = perturbed(LanguageModel(tiny_config(mixer, num_layers=3, exits=EXITS, ffn={"kind": ffn}),
                                    rngs=nnx.Rngs(0)))  # RWKV's zero-initialised output projections
    prompt = jax.random.randint(jax.random.key(1), (3, 4), 1, 256)
    for threshold in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99):  # rows apart at some tokens, all exited at others
        ref = exit_decode(model, prompt, threshold, steps=12, full_blocks=True)
        used = np.asarray(ref[1])
        if (used.min(0) < used.max(0)).any() and (used.max(0) < 3).any() and (used[0] < 3).any():
            break
    else:
        pytest.fail("no threshold made the rows exit at different layers and all of them early at some token")
    # The first row alone, as a batch of copies of it: every row exits where it does, so every block past its
    # exit only advances its state (as in a batch of one), and the batch's compiled programs serve.
    for rows in (prompt, jnp.repeat(prompt[:1], len(prompt), axis=0)):
        ref = exit_decode(model, rows, threshold, steps=12, full_blocks=True)
        new = exit_decode(model, rows, threshold, steps=12, full_blocks=False)
        assert np.array_equal(ref[0], new[0]) and np.array_equal(ref[1], new[1]), (len(rows), ref[:2], new[:2])
        # Bitwise equal under XLA's default CPU optimisation; at the suite's fast-compile level (conftest.py)
        # the smaller branch rounds Mamba's SSM update differently (1.7e-7 relative). A wrong state is O(1).
        assert_tree_close(new[2], ref[2], 1e-6, f"batch {len(rows)}: state")


def test_generate_runs_skipped_blocks_in_full_on_request(model):
    exits = Exits(0.9, measure="saturation")
    # the program of full_blocks=False is the saturation one of the first test
    full = infer.generate(model, PROMPTS, max_new_tokens=8, exits=dataclasses.replace(exits, full_blocks=True),
                          return_info=True)
    assert full == infer.generate(model, PROMPTS, max_new_tokens=8, exits=exits, return_info=True)


def test_exit_losses_fall_and_the_classifier_is_fitted(tmp_path):
    from train.loop import run
    from zoo.checkpoint import load_model

    cfg = from_dict({
        "model": {"d_model": 32, "num_layers": 3, "max_seq_len": 64, "mixer": {"kind": "attention", "num_heads": 2},
                  "exits": {**EXITS, "layer_dropout": 0.2, "classifier_steps": 10}},
        "train": {"steps": 25, "batch_size": 8, "seq_len": 32, "lr": 1e-2, "warmup_steps": 5, "log_every": 5,
                  "eval_every": 25, "eval_batches": 1, "checkpoint_every": 25, "sample_tokens": 0}})
    logs = []
    run(cfg, tmp_path / "run", log=logs.append)
    rows = [__import__("json").loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    for name in ("exit1_loss", "exit2_loss"):
        assert rows[-1][name] < rows[0][name] - 0.3, (name, rows[0][name], rows[-1][name])
    fit = [line for line in logs if line.startswith("exit classifiers")][0]
    before, after = (float(x) for x in fit.split("entropy ")[1].split(" in ")[0].split(" -> "))
    assert after < before, fit
    _, model, _ = load_model(tmp_path / "run")
    assert jnp.any(model.exit_classifier[...] != 0)


_forward = nnx.jit(lambda m, t: m(t))  # compiled once per mode (tests.util.forward compiles on every call)


def test_layer_dropout_only_in_training():
    model = exit_model(layer_dropout=0.5)
    tokens = jax.random.randint(jax.random.key(0), (16, 6), 1, 256)
    model.eval()
    plain = _forward(model, tokens)
    assert jnp.array_equal(plain, _forward(model, tokens))  # eval: no layer dropout
    model.train()
    rows_changed = jnp.any(jnp.abs(_forward(model, tokens) - plain) > 1e-4, axis=(1, 2))
    assert rows_changed.any() and not rows_changed.all()  # per row, not for the whole batch


@pytest.mark.parametrize("exits, message", [
    ({"layers": [3], "weights": [1.0]}, "model.exits.layers"),
    ({"layers": [2, 1], "weights": [1.0, 1.0]}, "model.exits.layers"),
    ({"layers": [1], "weights": []}, "model.exits.weights"),
    ({"layers": [1], "weights": [1.0], "layer_dropout": 1.0}, "model.exits.layer_dropout"),
    ({"layers": [1], "weights": [1.0], "heads": 2}, "model.exits.heads"),
])
def test_bad_exit_config_names_the_key(exits, message):
    with pytest.raises(ValueError, match=message):
        from_dict({"model": {"num_layers": 3, "exits": exits}})


def test_bad_exit_arguments_are_refused(model):
    plain = LanguageModel(tiny_config(), rngs=nnx.Rngs(0))
    for m, exits, message in [
        (plain, Exits(0.5), "needs a model with exits"),
        (model, Exits(1.5), r"\[0, 1\]"),
        (model, Exits(0.5, measure="entropy"), "exit_measure"),
    ]:
        with pytest.raises(ValueError, match=message):
            infer.generate(m, PROMPTS, max_new_tokens=2, exits=exits)


def test_command_line_prints_exit_layers(model, capsys, tmp_path):
    from infer.__main__ import main

    config = tmp_path / "exits.yaml"
    config.write_text("model: {d_model: 32, num_layers: 3, mixer: {kind: attention, num_heads: 4}, "
                      "exits: {layers: [1, 2], weights: [0.5, 0.5]}}\n")
    main([str(config), "--prompt", "ab", "--max-new-tokens", "4", "--exit-threshold", "0", "--show-exits"])
    assert "layers used per token (mean 1.00 of 3): 1 1 1 1" in capsys.readouterr().out
