"""Pruned models (infer/prune.py): every projection of an attention and a Mamba-2 model pruned to 2:4 or
half its inputs by each method, the heads and embeddings untouched; SparseGPT's output on the calibration
tokens closer to the float model's than magnitude pruning's; the pruned model decodes like its own full
pass and keeps its parameters' sharding axes (it trains and checkpoints as any model), and quantized after it
keeps its zeros; bad input named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer
from infer.quantize import is_projection, matrices
from tests.util import decode_in_pieces, forward, rel_err, tiny_model


@pytest.mark.parametrize("mixer", [{"kind": "attention", "num_heads": 4, "num_kv_heads": 2},
                                   {"kind": "mamba2", "state_size": 8, "head_dim": 16}], ids=lambda m: m["kind"])
def test_every_projection_is_pruned_and_the_model_decodes_like_its_full_pass(mixer):
    model = tiny_model(mixer, d_model=64, num_layers=2)
    cal = jax.random.randint(jax.random.key(0), (8, 48), 0, 256)
    ref = forward(model, cal)
    err = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        pruned = infer.prune(model, method, n_of_m=(2, 4), calibration=cal)
        entries = matrices(pruned)
        for (m, name, in_ndim, *_), (m0, *_rest) in zip(entries, matrices(model), strict=True):
            w = np.asarray(getattr(m, name).get_value())
            if is_projection(pruned, (m, name, in_ndim, *_)):  # (In, Out): 2 of every 4 inputs in each column
                zero = w.reshape(int(np.prod(w.shape[:in_ndim])), -1) == 0
                assert (zero.reshape(-1, 4, zero.shape[1]).sum(1) >= 2).all(), (method, name)
            else:
                np.testing.assert_array_equal(w, np.asarray(getattr(m0, name).get_value()))  # heads untouched
        err[method] = float(jnp.mean((forward(pruned, cal) - ref) ** 2))
    assert err["sparsegpt"] < err["magnitude"], err

    half = infer.prune(model, "sparsegpt", sparsity=0.5, calibration=cal)
    wq = half.blocks[0].mixer.wq if mixer["kind"] == "attention" else half.blocks[0].mixer.in_proj.kernel
    assert float(jnp.mean(wq.get_value() == 0)) == 0.5
    assert wq.get_metadata().get("axes") == (model.blocks[0].mixer.wq if mixer["kind"] == "attention"
                                             else model.blocks[0].mixer.in_proj.kernel).get_metadata().get("axes")
    pieces, _ = decode_in_pieces(half, cal, cuts=[17, 30, 31])
    assert rel_err(pieces, forward(half, cal)) < 1e-4

    # then quantized: GPTQ keeps the pruned zeros (layers/gptq.py), so each code is 0 where the weight is
    quantized = infer.quantize(half, "int4", group_size=16, calibration=cal)
    for (m, name, *_), (q, *_rest) in zip(matrices(half), matrices(quantized), strict=True):
        w, codes = np.asarray(getattr(m, name).get_value()), getattr(q, name).get_value()
        if is_projection(half, (m, name, *_)):
            assert not np.asarray(codes.values).reshape(w.shape)[w == 0].any(), name


def test_bad_input_is_named():
    model = tiny_model({"kind": "gla", "num_heads": 2}, d_model=64)
    with pytest.raises(ValueError, match="method='wanda' weighs the inputs: pass calibration"):
        infer.prune(model, "wanda")
    with pytest.raises(ValueError, match=r"prune: calibration is float32\[2, 8\]; expected token ids"):
        infer.prune(model, "sparsegpt", calibration=jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match=r"n_of_m=\(3, 3\); expected 0 < n < m"):
        infer.prune(model, "magnitude", n_of_m=(3, 3))
    assert nnx.state(model)  # untouched


def test_shrink_drops_zero_heads_and_channels_and_the_smaller_model_is_an_ordinary_one():
    model = tiny_model({"kind": "attention", "num_heads": 4}, d_model=64)
    cal = jax.random.randint(jax.random.key(0), (4, 40), 0, 256)
    for i, b in enumerate(model.blocks):  # head 1 or 2 and a quarter of the channels give nothing
        b.mixer.wo[...] = b.mixer.wo[...].at[1 + i].set(0)
        b.ffn.w_down[...] = b.ffn.w_down[...].at[i::4].set(0)
    small = infer.shrink(model, heads=0.25, channels=0.25, calibration=cal)
    assert (small.cfg.mixer.num_heads, small.cfg.mixer.head_dim, small.cfg.ffn.hidden_dim) == (3, 16, 144)
    np.testing.assert_array_equal(small.blocks[1].ffn.w_up.get_value(),
                                  np.delete(np.asarray(model.blocks[1].ffn.w_up.get_value()), np.s_[1::4], axis=1))
    assert rel_err(forward(small, cal), forward(model, cal)) < 1e-6
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert count(small) < 0.8 * count(model)
    pieces, _ = decode_in_pieces(small, cal, cuts=[13, 14])
    assert rel_err(pieces, forward(small, cal)) < 1e-4


def test_shrink_drops_relu2_channels_by_their_weights_alone():
    """Nemotron-H's MLP (relu2, no gate) ranked without calibration: its up and down norms."""
    model = tiny_model(d_model=32, num_layers=1, ffn={"kind": "mlp", "activation": "relu2", "hidden_dim": 64})
    model.blocks[0].ffn.w_down[...] = model.blocks[0].ffn.w_down[...].at[::4].set(0)
    small = infer.shrink(model, channels=0.25)
    cal = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    assert small.cfg.ffn.hidden_dim == 48 and rel_err(forward(small, cal), forward(model, cal)) < 1e-6


def test_shrink_refuses_the_heads_of_grouped_value_heads():
    model = tiny_model({"kind": "gated_deltanet", "num_heads": 2, "num_v_heads": 4}, num_layers=1)
    with pytest.raises(ValueError, match="grouped value heads"):
        infer.shrink(model, heads=0.5)


def test_shrink_gqa_keeps_every_group_and_an_expert_removed_is_one_never_chosen():
    model = tiny_model({"kind": "attention", "num_heads": 4, "num_kv_heads": 2}, d_model=64, num_layers=1,
                       ffn={"kind": "moe", "num_experts": 8, "top_k": 2, "balance": "bias"})
    model.eval()
    cal = jax.random.randint(jax.random.key(1), (4, 40), 0, 256)
    m = model.blocks[0]
    m.mixer.wo[...] = m.mixer.wo[...].at[np.array([1, 2])].set(0)  # one query head of each kv group
    small = infer.shrink(model, heads=0.5, experts=0.25, calibration=cal)
    assert (small.cfg.mixer.num_heads, small.cfg.mixer.num_kv_heads, small.cfg.ffn.num_experts) == (2, 2, 6)
    np.testing.assert_array_equal(small.blocks[0].mixer.wq.get_value(), m.mixer.wq.get_value()[:, [0, 3]])
    # the two experts of least mean router probability go; removing one equals never choosing it (its
    # selection bias -1e9: the renormalized gates of the others are the same)
    probe = nnx.clone(model)
    probe.blocks[0].ffn.deterministic = False
    _, sown = nnx.capture(probe, nnx.Intermediate)(cal)
    gone = np.argsort(nnx.to_pure_dict(sown)["blocks"][0]["ffn"]["moe"][0]["router_probs"])[:2]
    m.ffn.bias[...] = m.ffn.bias[...].at[gone].set(-1e9)
    small.eval()
    assert rel_err(forward(small, cal), forward(model, cal)) < 1e-6


@pytest.mark.parametrize("kind", ["gla", "gated_deltanet", "mamba2"])
def test_shrink_drops_a_linear_attention_head_or_ssm_state_channels_that_give_nothing(kind):
    cal = jax.random.randint(jax.random.key(2), (4, 40), 0, 256)
    if kind != "mamba2":  # heads of (K, V) = (8, 16) and (16, 32) states: head 2's output rows zero
        model = tiny_model({"kind": kind, "num_heads": 4}, d_model=64)
        V = model.blocks[0].mixer.o_proj.kernel.shape[0] // 4
        for b in model.blocks:
            b.mixer.o_proj.kernel[...] = b.mixer.o_proj.kernel[...].at[2 * V:3 * V].set(0)
        small = infer.shrink(model, heads=0.25, calibration=None if kind == "gla" else cal)  # GLA: by norms
        want = {"num_heads": 3, "expand_k": 0.375, "expand_v": 0.75} if kind == "gla" else \
            {"num_heads": 3, "head_dim": 16}
    else:  # 2 groups of 8 state channels: C's channels 1 and 6 of each group read nothing (projection and conv)
        model = tiny_model({"kind": kind, "state_size": 8, "head_dim": 16, "num_groups": 2}, d_model=64)
        for b in model.blocks:
            m, Di = b.mixer, b.mixer.d_inner
            c = np.array([1, 6, 9, 14])  # within C, group-major
            m.in_proj.kernel[...] = m.in_proj.kernel[...].at[:, 2 * Di + 16 + c].set(0)
            m.conv.weight[...] = m.conv.weight[...].at[:, Di + 16 + c].set(0)
            m.conv.bias[...] = m.conv.bias[...].at[Di + 16 + c].set(0)
        small, want = infer.shrink(model, state=0.25), {"state_size": 6}
    assert {k: getattr(small.cfg.mixer, k) for k in want} == want
    assert rel_err(forward(small, cal), forward(model, cal)) < 1e-5
    pieces, _ = decode_in_pieces(small, cal, cuts=[13, 14])
    assert rel_err(pieces, forward(small, cal)) < 1e-4


def test_shrink_bad_input_is_named():
    model = tiny_model({"kind": "mamba2", "state_size": 8, "head_dim": 16}, d_model=64)
    with pytest.raises(ValueError, match="shrink: heads=0.5 removes Attention or GatedDeltaNet or GatedLinearAttention "
                                         "heads; this model's layers are MLP, Mamba2"):
        infer.shrink(model, heads=0.5)
    with pytest.raises(ValueError, match=r"shrink: channels=1.0; expected the fraction .* in \[0, 1\)"):
        infer.shrink(model, channels=1.0)
    with pytest.raises(ValueError, match="experts= ranks experts by their router probability: pass calibration"):
        infer.shrink(tiny_model(ffn={"kind": "moe", "num_experts": 4}), experts=0.5)
    with pytest.raises(ValueError, match="shrink: heads=0.9 would remove all 4 heads of a layer"):
        infer.shrink(tiny_model(), heads=0.9)
