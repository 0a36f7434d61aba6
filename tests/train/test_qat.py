"""Quantization-aware training (train.qat, infer/quantize.fake_quantize): the training forward is the
quantized model's function number for number, its gradient reaches the float weights straight through,
and a run trains through the loop and decodes from `python -m infer` in the form it trained."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer.__main__ import main as infer_main
from infer.quantize import fake_quantize, matrices
from layers.quant import Int8Rows, quantize_weight
from tests.layers.conformance import perturbed
from tests.train.test_configs import SHRINK
from tests.util import assert_tree_close, tiny_model
from train.loop import run
from zoo import load_config
from zoo.checkpoint import load_model

KINDS = {"attention": {"kind": "attention", "num_heads": 4, "num_kv_heads": 2},  # tied embedding: W8A8 head
         "mamba2": {"kind": "mamba2", "state_size": 8, "head_dim": 16}}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)


def loss(model, tokens=TOKENS):
    logits = nnx.view(model, deterministic=True)(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


@pytest.mark.parametrize("kind, bits, activations", [("attention", "int4", "int8"), ("attention", "int4", "float"),
                                                       ("mamba2", "int8", "int8"), ("mamba2", "int4", "float")])
def test_the_training_forward_is_the_quantized_model_and_its_gradient_passes_straight_through(kind, bits, activations):
    model = perturbed(tiny_model(KINDS[kind], d_model=64, num_layers=2))
    quantized = infer.quantize(model, bits, group_size=16, activations=activations)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def qat_loss(params):
        return loss(fake_quantize(nnx.merge(graphdef, params, rest, copy=True), bits, group_size=16,
                                  activations=activations))

    view = nnx.jit(lambda m: nnx.view(m, deterministic=True)(TOKENS))
    np.testing.assert_array_equal(view(fake_quantize(nnx.clone(model), bits, group_size=16, activations=activations)),
                                  view(quantized), "the QAT forward is not the quantized model's, number for number")
    grads = jax.jit(jax.grad(qat_loss))(params)
    if activations == "float":  # straight through: the gradient of the float model holding the rounded weights
        rounded = nnx.clone(model)
        for (m, name, *_), (q, _, *_) in zip(matrices(rounded), matrices(quantized), strict=True):
            getattr(m, name).set_value(getattr(q, name).get_value().dequantize())
        rounded_loss = lambda p: loss(nnx.merge(graphdef, p, rest, copy=True))
        want = jax.jit(jax.grad(rounded_loss))(nnx.split(rounded, nnx.Param, ...)[1])
        assert_tree_close(grads, want, 1e-5, "QAT gradient vs the rounded model's")
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(g).all() and np.abs(g).max() > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_int8_rows_differentiate_the_rounded_rows_times_the_read_weight():
    rng = np.random.default_rng(1)
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 16), (16, 8), (5, 8)))
    q = quantize_weight(w, "int8", dot="int8")
    read = q.dequantize()
    y, pull = jax.vjp(lambda x, base: Int8Rows(base, q).matmul(x), x, read)
    np.testing.assert_array_equal(y, q.matmul(x))
    dx, dw = pull(g)
    scale = jnp.max(jnp.abs(x), -1, keepdims=True) / 127
    assert_tree_close((dx, dw), (g @ read.T, (jnp.round(x / scale) * scale).T @ g), 1e-6, "Int8Rows vjp")


def test_a_qat_run_trains_and_decodes_as_trained(tmp_path, capsys):
    run(load_config("configs/transformer.yaml", [*SHRINK, "train.qat={bits: int4, group_size: 16}"]), tmp_path,
        log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    _, model, _ = load_model(tmp_path)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model, nnx.Param))), "float at rest"
    want = infer.generate_text(infer.quantize(model, "int4", group_size=16), ["ROMEO:"], max_new_tokens=8,
                               sampling=infer.Sampling(0.0))
    capsys.readouterr()
    infer_main([str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"])
    out = capsys.readouterr()
    assert "decoding as trained (train.qat): int4 weights in groups of 16, int8 activations" in out.err
    assert want[0] in out.out


@pytest.mark.parametrize("override, message", [
    ("train.qat={bits: int3}", "train.qat.bits: expected one of 'int8', 'int4', got 'int3'"),
    ("train.qat={bits: int4, group_size: 0}", "train.qat.group_size: expected 1 <= group_size"),
    ("train.qat={bits: int4, activations: int4}", "train.qat.activations: expected one of"),
])
def test_bad_qat_sections_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("configs/transformer.yaml", [override])


def test_qat_refuses_what_it_cannot_follow():
    with pytest.raises(ValueError, match="train.qat: with train.lora"):
        load_config("configs/transformer.yaml", ["train.qat={bits: int4}", "train.lora={rank: 4}"])
    model = tiny_model(KINDS["attention"], d_model=48, num_layers=1)
    with pytest.raises(ValueError, match="train.qat: group_size=32 must divide the input width of every int4 "
                                         "weight; .*has 48"):
        fake_quantize(nnx.clone(model), "int4", group_size=32)
    exits = tiny_model(KINDS["attention"], d_model=64, num_layers=2,
                       exits={"layers": [1], "weights": [0.5], "own_head": True})
    with pytest.raises(ValueError, match="activations='int8' with exit heads"):
        fake_quantize(nnx.clone(exits), "int8")
