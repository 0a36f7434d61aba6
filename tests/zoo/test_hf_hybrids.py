"""Every hybrid architecture zoo.hf loads serves through the zoo's decoding features, from its fixture folder
(tests/fixtures/hf, written by transformers: make_fixtures.py): its int8 copy (W8A8 products) decodes in pieces as
its own full pass; exits added to it (fresh exit norms, the shared head, the rest read from the folder) leave its
greedy tokens as they were: self-speculation from its first layer gives transformers' greedy tokens exactly
(test_hf: the loaded model's too; the drafts of one layer are often rejected, so every layer kind rolls back); and
token-level exit at threshold 0 leaves every generated token at the exit. And a run with model.init_from a
hybrid's folder starts from its weights, the MoE's router bias (DeepSeek-V3's e_score_correction_bias, state
beside the parameters) included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
import zoo.hf
from tests.util import HF_FIXTURES as FIXTURES
from tests.util import assert_close, decode_in_pieces, forward, hf_greedy
from zoo import LanguageModel
from zoo.config import ExitsConfig

HYBRIDS = ["qwen3_next", "kimi_linear", "deepseek_v3", "jamba", "nemotron_h", "lfm2", "recurrent_gemma", "falcon_h1"]


@pytest.mark.parametrize("case", HYBRIDS)
def test_a_loaded_hybrid_decodes_quantized_exits_and_speculates(case, monkeypatch):
    # W8A8 rounds every product's input to int8: the forward and the decode agree to 1e-4 only where their attention
    # is the same computation to the last bit, so both run the XLA forms here (the CPU kernels' forward differs
    # from the cache path's in the 7th digit, and one activation then rounds the other way: 2e-2 in
    # recurrent_gemma). The kernels themselves: tests/kernels/test_attention_cpu.py.
    monkeypatch.setenv("ZOO_CPU_KERNELS", "0")
    model, tok = zoo.hf.load(FIXTURES / case)
    tokens = jnp.asarray(np.load(FIXTURES / case / "expected.npz")["ids"][:, :6], jnp.int32)
    int8 = infer.quantize(model, "int8")  # a prefill of 5, then one token
    assert_close(decode_in_pieces(int8, tokens, [5])[0], forward(int8, tokens), 1e-4, f"{case} int8 decode")

    exits = LanguageModel(dataclasses.replace(model.cfg, exits=ExitsConfig(layers=(1,), weights=(1.0,))),
                          rngs=nnx.Rngs(0))
    nnx.update(exits, nnx.state(model))  # parameters and the rest (a router bias)
    exits.eval()
    prompts, greedy = hf_greedy(case, tok)
    # exact: self-speculation gives the greedy tokens of the model with exits
    assert infer.generate(exits, prompts, max_new_tokens=10, stop_token=tok.eos_id,
                          speculation=infer.Speculation(3)) == greedy
    _, info = infer.generate(exits, prompts, max_new_tokens=6, exits=infer.Exits(0.0), return_info=True)
    assert all(layer == 1 for row in info["exit_layers"] for layer in row[1:])  # the prompt's token: full depth


def test_a_run_starts_from_a_hybrid_folders_weights_and_router_bias(tmp_path):
    """DeepSeek-V3: an ffn_pattern (dense, then MoE) and a router bias (its e_score_correction_bias). (Kimi Linear's
    KDA layers beside would add 4 CPU-s of compile and nothing init_from reads differently.)"""
    from train.loop import run
    from zoo.checkpoint import load_model
    overrides = ["model.init_from=tests/fixtures/hf/deepseek_v3", "train.steps=1", "train.lr=1e-9",
                 "train.warmup_steps=0", "train.batch_size=2", "train.seq_len=16", "train.eval_every=1",
                 "train.checkpoint_every=1"]
    run(zoo.load_config("configs/finetune.yaml", overrides), tmp_path, log=lambda *_: None)
    _, trained, _ = load_model(tmp_path)
    loaded, _ = zoo.hf.load(FIXTURES / "deepseek_v3")
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
    for a, b in zip(leaves(trained), leaves(loaded), strict=True):  # one step at lr 1e-9 moves nothing visible
        np.testing.assert_allclose(a, b, atol=1e-6)
    moe = [i for i, f in enumerate(loaded.cfg.ffns()) if f.KIND == "moe"][0]
    bias = lambda m: np.asarray(m.blocks[moe].ffn.bias[...])
    rate = loaded.cfg.ffns()[moe].bias_update_rate  # one step moves each entry by at most the update rate
    assert np.abs(bias(loaded)).max() > 10 * rate and np.abs(bias(trained) - bias(loaded)).max() <= rate + 1e-6
