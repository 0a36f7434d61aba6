"""python -m train.compress (train/compress.py): a trained run shrunk, pruned and quantized into a new run
folder that `python -m infer` decodes exactly as the same compression in memory does; a float result is
an ordinary run that trains on (from it, distilled from the original run); bad flags named."""

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

import infer
from infer.__main__ import main as infer_main
from tests.train.test_configs import SHRINK
from train.compress import calibration_tokens, compress, main
from train.extrapolate import extrapolate
from train.loop import run
from zoo import load_config
from zoo.checkpoint import load_model

GREEDY = ["--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    run(load_config("configs/transformer.yaml", SHRINK), folder, log=lambda _: None)
    return folder


def test_a_quantized_folder_decodes_as_the_compression_in_memory(trained, tmp_path, capsys):
    out = tmp_path / "small"
    main([str(trained), "--out", str(out), "--shrink", "heads=0.25", "channels=0.5", "--prune", "sparsegpt",
          "--n-of-m", "2:4", "--quantize", "int4", "--method", "gptq", "--group-size", "16", "--head", "int8",
          "--calibration", "4"])
    assert "bytes of weights ->" in capsys.readouterr().out
    cfg, model, _ = load_model(trained)
    model.eval()
    want = compress(model, calibration_tokens(cfg, 4), dict(heads=0.25, channels=0.5),
                    dict(method="sparsegpt", sparsity=None, n_of_m=(2, 4)),
                    dict(weights="int4", method="gptq", group_size=16, head="int8"))
    text = infer.generate_text(want, ["ROMEO:"], max_new_tokens=8, sampling=infer.Sampling(0.0))[0]
    infer_main([str(out), *GREEDY])
    assert "ROMEO:" + text in capsys.readouterr().out
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert (saved["mixer"]["num_heads"], saved["ffn"]["hidden_dim"]) == (3, want.cfg.ffn.hidden_dim)
    _, loaded, _ = load_model(out)  # any loader reads it: evaluation too
    assert extrapolate(loaded, cfg, (1,), 1)[0]["loss_per_bucket"][0] == extrapolate(want, cfg, (1,), 1)[0][
        "loss_per_bucket"][0]
    with pytest.raises(ValueError, match="holds a quantized model \\(int4 gptq, python -m train.compress\\): it is "
                                         "read on one device, with its own config"):
        load_model(out, config="configs/transformer.yaml")
    with pytest.raises(SystemExit, match="holds quantized weights already"):
        infer_main([str(out), "--quantize", "int8"])


def test_a_shrunk_folder_is_a_run_that_trains_on_distilled_from_the_original(trained, tmp_path):
    out = tmp_path / "small"
    main([str(trained), "--out", str(out), "--shrink", "channels=0.5", "--calibration", "2"])
    cfg, model, _ = load_model(out)  # an ordinary float run
    assert model.blocks[0].ffn.w_down.shape[0] == cfg.model.ffn.hidden_dim == 96
    run(load_config(str(out / "config.yaml"), ["train.steps=4", "train.eval_every=4", "train.checkpoint_every=4",
                                                f"train.distill={{teacher: {trained}, start_from: {out}}}"]),
        tmp_path / "tuned", log=lambda _: None)
    _, tuned, step = load_model(tmp_path / "tuned")
    assert step == 4 and all(np.isfinite(x).all() for x in jax.tree.leaves(nnx.state(tuned, nnx.Param)))


@pytest.mark.parametrize("flags, message", [
    ([], "nothing to do: give --shrink, --prune or --quantize"),
    (["--shrink", "heads"], "--shrink heads: expected heads=, channels=, experts= or state= a share"),
    (["--prune", "wanda"], "--prune wanda: give --sparsity or --n-of-m"),
    (["--prune", "wanda", "--n-of-m", "2-4"], "--n-of-m 2-4: expected N:M"),
    (["--sparsity", "0.5"], "--sparsity and --n-of-m are --prune's"),
    (["--kv-cache", "int8"], "--kv-cache and --head go with --quantize"),
    (["--quantize", "int3"], "weights='int3' is GPTQ's"),
    (["--shrink", "heads=1"], "shrink: heads=1.0; expected the fraction"),
])
def test_bad_flags_are_named_before_anything_is_written(trained, tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        main([str(trained), "--out", str(tmp_path / "x"), *flags])
    assert not (tmp_path / "x").exists()
