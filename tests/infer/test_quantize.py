import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer import Quantization
from infer.generate import TRACES
from layers.quant import Quantized, quantize_weight
from tests.util import decode_in_pieces, forward, rel_err, tiny_model


def realistic(model):
    """A tiny model whose tied embedding has a trained model's scale (std 0.25, not init's 0.02), so
    its logits spread over a few nats as a trained model's do and errors are measured against that."""
    emb = model.embed.embedding
    emb.set_value(emb.get_value() * 12.5)
    return model


@pytest.fixture(scope="module")
def model():
    return realistic(tiny_model({"kind": "attention", "num_heads": 4, "num_kv_heads": 2}, d_model=64))


def column_scales(w):
    """Columns of very different sizes, and one of zeros: the scale is per column."""
    return w * jnp.logspace(-3, 1, w.shape[-1]).at[0].set(0.0)


def test_int8_per_channel_round_trip_is_within_half_a_step():
    w = column_scales(jax.random.normal(jax.random.key(0), (48, 40)))
    q = quantize_weight(w, "int8")
    assert q.values.dtype == jnp.int8 and q.scale.shape == (1, 40)
    assert int(jnp.abs(q.values.astype(jnp.int32)).max()) <= 127
    err = jnp.abs(w - q.dequantize())
    assert bool(jnp.all(err <= q.scale[0] / 2 * (1 + 1e-6)))
    assert float(jnp.abs(q.dequantize()[:, 0]).max()) == 0.0


@pytest.mark.parametrize("shape, in_ndim, lead, transposed", [
    ((64, 24), 1, 0, False),  # a Linear kernel or MLP weight (In, Out)
    ((2, 32, 24), 2, 0, False),  # attention's wo (H, K, D): contracted over two axes
    ((3, 32, 24), 1, 1, False),  # stacked exit heads (E, D, V)
    ((24, 64), 1, 0, True),  # a tied embedding (V, D): the head's columns are its rows
])
def test_int4_grouped_round_trip_is_within_half_a_step(shape, in_ndim, lead, transposed):
    w = jax.random.normal(jax.random.key(1), shape)
    q = quantize_weight(w, "int4", in_ndim=in_ndim, lead=lead, group_size=16, transposed=transposed)
    assert q.values.dtype == jnp.int4 and q.scale.dtype == jnp.bfloat16
    assert int(jnp.abs(q.values.astype(jnp.int32)).max()) <= 7
    deq = q.dequantize()
    assert deq.shape == shape
    # the step of each weight: its (column, group) scale, laid out like w
    step = jnp.repeat(q.scale.astype(jnp.float32), 16, axis=-2).reshape(q.values.shape)
    step = step.T if transposed else step.reshape(shape)
    assert bool(jnp.all(jnp.abs(w - deq) <= step / 2 * (1 + 1e-6)))
    assert q.nbytes == w.size // 2 + q.scale.nbytes


def test_int4_requantized_to_int8_is_within_half_an_int8_step():
    q = quantize_weight(jax.random.normal(jax.random.key(6), (64, 24)), "int4", group_size=16)
    codes, scale = q.as_int8()  # what the W8A8 product multiplies by
    assert codes.dtype == jnp.int8 and int(jnp.abs(codes.astype(jnp.int32)).max()) == 127
    assert bool(jnp.all(jnp.abs(q.dequantize() - codes * scale) <= scale / 2 * (1 + 1e-6)))


def test_quantized_logits_stay_close_to_float(model):
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 256)
    ref = forward(model, tokens)
    assert float(ref.std()) > 1.0  # logits of a trained model's spread
    # max |logit error| / max |logit|, here 0.031 (W8A8), 0.020 (int8 read as float) and 0.36 (int4): one
    # product with Gaussian weights errs by 0.7% (int8) or 9.7% (int4, groups of 32: round-to-nearest
    # int4 is that coarse), and a logit passes through about ten (a trained model's loss moves far
    # less: benchmarks/quantize.py). The bounds leave room for other machines' rounding.
    for kwargs, tol in [(dict(weights="int8", activations="int8"), 0.05),
                        (dict(weights="int8", activations="float"), 0.05), (dict(weights="int4"), 0.5)]:
        q = infer.quantize(model, **kwargs)
        assert rel_err(forward(q, tokens), ref) < tol, kwargs
    assert not isinstance(model.blocks[0].mixer.wq.get_raw_value(), Quantized)  # the original is untouched
    assert isinstance(q.blocks[0].mixer.wq.get_raw_value(), Quantized)
    assert isinstance(q.embed.embedding.get_raw_value(), Quantized)  # tied: the head is quantized too


def test_untied_head_and_exit_heads_are_quantized():
    m = realistic(tiny_model(d_model=64, num_layers=2, tie_embeddings=False,
                             exits={"layers": [1], "weights": [1.0], "own_head": True}))
    q = infer.quantize(m, "int8")
    assert isinstance(q.head.get_raw_value(), Quantized) and isinstance(q.exit_heads.get_raw_value(), Quantized)
    assert not isinstance(q.embed.embedding.get_raw_value(), Quantized)  # an untied table is only looked up
    h = jax.random.normal(jax.random.key(3), (1, 5, 64))
    assert rel_err(q.exit_logits(0, h), m.exit_logits(0, h)) < 0.03
    # head="int8" / "float": the heads stay int8 per column or float while the projections take int4
    kept = infer.quantize(m, "int4", group_size=16, head="int8")
    assert kept.head.get_raw_value().bits == kept.exit_heads.get_raw_value().bits == "int8"
    assert kept.blocks[0].mixer.wq.get_raw_value().bits == "int4"
    whole = infer.quantize(m, "int4", group_size=16, head="float")
    np.testing.assert_array_equal(whole.head.get_value(), m.head.get_value())
    assert whole.blocks[0].ffn.w_up.get_raw_value().bits == "int4"


def test_int8_kv_cache_decodes_close_to_the_float_cache(model):
    q = infer.quantize(model, weights=None, kv_cache="int8")
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 256)
    ref = forward(model, tokens)
    logits, state = decode_in_pieces(q, tokens, [5, 6, 7, 8, 9, 10, 11])  # prefill 5, then one at a time
    cache = state[0][0]
    assert cache.k.dtype == jnp.int8 and cache.k_scale.shape == (2, 2, 12, 1)
    assert model.init_state(1, 4)[0][0].k_scale is None  # the original keeps its float cache
    assert rel_err(logits, ref) < 0.03  # 0.013 here; the float cache gives ~1e-6 (a key's step is max|k| / 127)


def test_generate_with_quantization_returns_tokens(model):
    before = TRACES["generate"]
    int4_int8 = Quantization(weights="int4", kv_cache="int8")
    out = infer.generate(model, [[5, 6, 7], [42]], max_new_tokens=4, quantization=int4_int8)
    assert [len(r) for r in out] == [4, 4] and all(0 <= t < 256 for r in out for t in r)
    again = infer.generate(model, [[5, 6, 8], [43]], max_new_tokens=4, quantization=int4_int8)
    assert TRACES["generate"] - before == 1 and len(again) == 2  # a new copy each call, one compiled program


def test_bad_options_name_what_was_expected(model):
    for kwargs, message in [
        (dict(weights="int2"), r"weights='int2'; expected one of \('int8', 'int4', 'int3'\)"),
        (dict(kv_cache="fp8"), r"kv_cache='fp8'; expected one of \('int8',\)"),
        (dict(activations="int4"), r"activations='int4'"),
        (dict(weights="int4", head="int4"), r"head='int4'; expected 'int8', 'float' or None"),
        (dict(weights="int4", group_size=5), r"group_size=5; expected an even integer"),
        (dict(weights="int4", group_size=128), r"group_size=128 must divide the input width of every int4 "
                                               r"weight; blocks.0.ffn.w_gate has 64.*fit this model: 64, 32, 16, 8"),
    ]:
        with pytest.raises(ValueError, match=message):
            infer.quantize(model, **kwargs)
    with pytest.raises(ValueError, match="quantize: weights='int2'"):
        infer.generate(model, [[1]], max_new_tokens=1, quantization=Quantization("int2"))
    with pytest.raises(ValueError, match="needs attention layers"):
        infer.quantize(tiny_model({"kind": "gla", "num_heads": 2}), kv_cache="int8")


def test_command_line_quantized(capsys, tmp_path):
    from infer.__main__ import main

    config = tmp_path / "tiny.yaml"
    config.write_text("model: {d_model: 32, num_layers: 1, mixer: {kind: attention, num_heads: 4}}\n")
    main([str(config), "--prompt", "ab", "--max-new-tokens", "3", "--quantize", "int8", "--kv-cache", "int8"])
    assert capsys.readouterr().out.startswith("ab")


def test_command_line_quantizes_on_a_calibration_text(capsys, tmp_path):
    """--method gptq --calibration FILE: the text's token windows calibrate GPTQ once, and the greedy tokens
    are those of infer.quantize(..., calibration=those windows); a missing text or bit width is named."""
    import argparse

    from infer.__main__ import calibration, main
    from zoo import LanguageModel, load_config

    config, text = tmp_path / "tiny.yaml", tmp_path / "calibration.txt"
    config.write_text("model: {d_model: 32, num_layers: 1, mixer: {kind: attention, num_heads: 4}}\n")
    text.write_text("To be, or not to be, that is the question. " * 8)
    flags = ["--quantize", "int4", "--method", "gptq", "--calibration", str(text)]
    main([str(config), "--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0", *flags])
    tokens = calibration(argparse.Namespace(quantize="int4", method="gptq", calibration=str(text)), None)
    assert tokens.shape == (2, 128)  # 352 bytes: two windows
    cfg = load_config(config)
    q = infer.quantize(LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), "int4", calibration=tokens)
    want = infer.generate_text(q, ["ab"], max_new_tokens=5, sampling=infer.Sampling(0.0))[0]
    assert capsys.readouterr().out == f"ab{want}\n"
    for argv, error in ((flags[:4], "--method gptq needs --quantize BITS and --calibration FILE"),
                        ([*flags[:5], str(tmp_path / "none.txt")], "none.txt: no such file")):
        with pytest.raises(SystemExit, match=error):
            main([str(config), *argv])


def test_linear_kernels_and_moe_experts_are_quantized():
    m = realistic(tiny_model({"kind": "linear_attention", "num_heads": 2}, d_model=32, num_layers=1,
                             ffn={"kind": "moe", "num_experts": 2, "top_k": 2}))
    q = infer.quantize(m, "int8")
    kernels = [v for p, v in nnx.to_flat_state(nnx.state(q, nnx.Param)) if p[-1] in ("kernel", "w_gate")]
    assert kernels and all(isinstance(v.get_raw_value(), Quantized) for v in kernels)
    tokens = jax.random.randint(jax.random.key(5), (1, 16), 0, 256)
    assert rel_err(forward(q, tokens), forward(m, tokens)) < 0.05


@pytest.mark.parametrize("kind", ["rwkv6", "rwkv7"])
def test_rwkv_matrices_are_quantized_and_pruned(kind):
    """RWKV's receptance, key, value, (gate,) output and channel-mix matrices go through `project`, so every
    method treats them: int8 codes, and a pruned model with half of each column zero."""
    m = tiny_model({"kind": kind, "head_dim": 16}, d_model=32, num_layers=2, ffn={"kind": f"{kind}_channel_mix"})
    names = {"rwkv6": ("w_r", "w_k", "w_v", "w_g", "w_o"), "rwkv7": ("w_r", "w_k", "w_v", "w_o")}[kind]
    mixer, ffn = m.blocks[1].mixer, m.blocks[1].ffn
    params = [(mixer, n) for n in names] + [(ffn, n) for n in ("w_k", "w_v", "w_r")[:3 if kind == "rwkv6" else 2]]
    for module, name in params:  # RWKV starts some of these at zero: give them values to prune
        getattr(module, name).set_value(jax.random.normal(jax.random.key(len(name)), getattr(module, name).shape))
    q, pruned = infer.quantize(m, "int8"), infer.prune(m, "magnitude", sparsity=0.5)
    tokens = jax.random.randint(jax.random.key(5), (1, 16), 0, 256)
    for path in [f"blocks.1.mixer.{n}" for n in names] + [f"blocks.1.ffn.{n}" for _, n in params[len(names):]]:
        held = nnx.state(q, nnx.Param)
        for part in path.split("."):
            held = held[int(part) if part.isdigit() else part]
        assert isinstance(held.get_raw_value(), Quantized), path
    for module, name in params:
        w = getattr(pruned.blocks[1].mixer if module is mixer else pruned.blocks[1].ffn, name).get_value()
        assert float(jnp.mean(w == 0)) == 0.5, name
    assert rel_err(forward(q, tokens), forward(m, tokens)) < 0.05


@pytest.mark.parametrize("mixer", [{"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
                                   {"kind": "mamba2", "state_size": 8, "head_dim": 16}], ids=lambda m: m["kind"])
def test_gptq_on_calibration_tokens_beats_round_to_nearest_and_decodes_like_its_full_pass(mixer):
    """infer.quantize(..., calibration=tokens): every projection read through `project` gets the GPTQ
    codes of its own inputs' Hessian (one float forward pass; the head stays rounded to nearest), and
    each projection's calibration error tr(dW^T H dW) is below round-to-nearest's (what GPTQ minimises;
    on this random-init model the logits' error on held-out random tokens is dominated by the head's and
    is not a test of it); int3 (GPTQ only) runs; the quantized model decodes like its full pass."""
    from infer.quantize import input_hessians, is_projection, matrices

    model = tiny_model(mixer, d_model=64, num_layers=2)
    cal, test = (jax.random.randint(k, (8, 48), 0, 256) for k in jax.random.split(jax.random.key(0)))
    rtn, gptq = (infer.quantize(model, "int4", group_size=16, activations="float", **kw)
                 for kw in ({}, {"calibration": cal}))
    todo = [t for t in matrices(model) if is_projection(model, t)]
    hessians = input_hessians(model, todo, cal)  # puts the weights back
    assert sorted(hessians) == list(range(len(todo))) and len(todo) > 4  # every projection
    weights = lambda q: [getattr(m, n).get_value() for m, n, *_ in matrices(q)][:len(todo)]
    for i, ((_, name, in_ndim, *_), w, a, b) in enumerate(zip(todo, weights(model), weights(rtn), weights(gptq),
                                                             strict=True)):
        In = math.prod(w.shape[:in_ndim])
        objective = lambda q: float(jnp.sum((d := (q.dequantize() - w).reshape(In, -1)) * (hessians[i] @ d)))
        assert objective(b) < objective(a), (name, objective(b), objective(a))
    ref = forward(model, test)  # held-out logits: int3 is worse than int4, and not by orders of magnitude
    err = lambda q: float(jnp.mean((forward(q, test) - ref) ** 2))
    int3 = infer.quantize(model, "int3", group_size=16, activations="float", calibration=cal, act_order=True)
    assert err(gptq) < err(int3) < 5 * err(rtn)
    pieces, _ = decode_in_pieces(gptq, test, cuts=[17, 30, 31])
    assert rel_err(pieces, forward(gptq, test)) < 1e-4


def test_gptq_bad_input_names_it(model):
    with pytest.raises(ValueError, match="weights='int3' is GPTQ's: pass calibration"):
        infer.quantize(model, "int3")
    with pytest.raises(ValueError, match=r"calibration is float32\[2, 8\]; expected token ids \(B, T\)"):
        infer.quantize(model, "int4", calibration=jnp.zeros((2, 8)))


@pytest.mark.parametrize("mixer", [{"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
                                   {"kind": "mamba2", "state_size": 8, "head_dim": 16}], ids=lambda m: m["kind"])
def test_awq_and_smoothquant_scale_every_projection_and_decode_like_their_full_pass(mixer):
    """method="awq": every projection read through `project` holds its searched input scales, and its
    calibration error tr(dW^T H dW) is at most round-to-nearest's; method="smoothquant": the migrated
    float model computes the original's logits bit for bit (the scales are powers of two), and its W8A8
    copy holds int8 weights behind the scales and errs about as plain W8A8 does (tests/layers/test_smooth.py
    shows the gain on outlier channels, which this random-init model lacks); both decode like their own
    full pass."""
    from infer.quantize import input_statistics, is_projection, matrices
    from layers.smooth import Scaled, scaled, smoothquant_scales

    model = tiny_model(mixer, d_model=64, num_layers=2)
    cal, test = (jax.random.randint(k, (8, 48), 0, 256) for k in jax.random.split(jax.random.key(1)))
    rtn = infer.quantize(model, "int4", group_size=16, activations="float")
    awq = infer.quantize(model, "int4", group_size=16, activations="float", calibration=cal, method="awq")
    todo = [t for t in matrices(model) if is_projection(model, t)]
    stats = input_statistics(model, todo, cal)
    weights = lambda q: [getattr(m, n).get_value() for m, n, *_ in matrices(q)][:len(todo)]  # noqa: E731
    migrated = nnx.clone(model)
    for i, ((_, name, in_ndim, *_), w, a, b, (m, *_)) in enumerate(
            zip(todo, weights(model), weights(rtn), weights(awq), matrices(migrated), strict=False)):
        In = math.prod(w.shape[:in_ndim])
        objective = lambda dense: float(jnp.sum((d := (dense - w).reshape(In, -1)) * (stats[i]["xtx"] @ d)))  # noqa: E731
        assert isinstance(b, Scaled) and objective(jnp.asarray(b)) <= objective(a.dequantize()) * (1 + 1e-6), name
        s = smoothquant_scales(w.reshape(In, -1), jnp.asarray(stats[i]["absmax"]))
        setattr(m, name, nnx.Param(scaled(w, s, in_ndim)))
    assert (forward(migrated, test) == forward(model, test)).all()
    smooth = infer.quantize(model, "int8", calibration=cal, method="smoothquant")
    held = weights(smooth)
    assert all(isinstance(h, Scaled) and isinstance(h.base, Quantized) and h.base.dot == "int8" for h in held)
    ref = forward(model, test)  # no outlier channels in a random-init model: smoothing must not cost much
    assert rel_err(forward(smooth, test), ref) < 1.5 * rel_err(forward(infer.quantize(model, "int8"), test), ref)
    # int8 activations are rounded per token in each program: the decode's and the full pass's programs may
    # round a value lying at a half step differently (one code, one step of max|x| / 127: 0.031 here)
    for q, tol in ((awq, 1e-4), (smooth, 0.05)):
        pieces, _ = decode_in_pieces(q, test, cuts=[17, 30, 31])
        assert rel_err(pieces, forward(q, test)) < tol


def test_awq_and_smoothquant_bad_input_names_it(model):
    cal = jnp.zeros((2, 8), jnp.int32)
    for kw, error in (({"method": "gptqq", "calibration": cal}, r"method='gptqq'; expected one of \('rtn'"),
                      ({"method": "awq"}, "method='awq' reads calibration: pass token ids"),
                      ({"method": "rtn", "calibration": cal}, "method='rtn' reads no calibration"),
                      ({"weights": "int4", "method": "smoothquant", "calibration": cal},
                       "method='smoothquant' is W8A8: weights='int8' and activations='int8', not 'int4' and 'int8'"),
                      ({"weights": "int3", "method": "awq", "calibration": cal}, "weights='int3' is GPTQ's")):
        with pytest.raises(ValueError, match=error):
            infer.quantize(model, **{"weights": "int8", **kw})
