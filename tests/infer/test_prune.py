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
