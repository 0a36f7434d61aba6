import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from infer.__main__ import main as infer_main
from train import optim
from train.data import segment_ids
from train.loop import run
from train.prepare import prepare
from train.step import make_train_step
from zoo.checkpoint import load_model
from zoo.config import from_dict, to_dict
from zoo.model import LanguageModel

ROOT = Path(__file__).parents[2]


def tiny(tmp_path, **train):
    return from_dict({
        "model": {"d_model": 32, "num_layers": 1, "max_seq_len": 64, "mixer": {"kind": "attention", "num_heads": 2}},
        "train": {"steps": 30, "batch_size": 8, "seq_len": 32, "lr": 1e-2, "warmup_steps": 5, "log_every": 5,
                  "eval_every": 15, "eval_batches": 2, "checkpoint_every": 10, "sample_tokens": 8,
                  "run_dir": str(tmp_path / "run"), **train}})


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_main_job_end_to_end(tmp_path, capsys):
    cfg = tiny(tmp_path)
    last = run(cfg, tmp_path / "run")
    rows = metrics(tmp_path / "run")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5 and len(val) == 2 and val[1] < val[0]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30] and "sample" in rows[-1]
    assert {"step", "tokens", "loss", "lr", "val_loss"} <= set(last)
    _, model, step = load_model(tmp_path / "run")
    assert step == 30
    capsys.readouterr()
    infer_main([str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "5"])
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    cfg = tiny(tmp_path).train
    graphdef, params, rest = nnx.split(LanguageModel(tiny(tmp_path).model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optim.optimizer(cfg)
    step = make_train_step(graphdef, tx)
    batch = prepare(tiny(tmp_path).data).batches(32, seed=0, packing=True).train_batch(0, 8)
    out = {}
    for k in (1, 4):
        p = jax.tree.map(jnp.copy, params)
        split = {n: v.reshape(k, 8 // k, 32) for n, v in batch.items()}
        out[k] = step(p, rest, tx.init(p), split)
    (p1, _, _, m1), (p4, _, _, m4) = out[1], out[4]
    assert abs(float(m1["loss"]) - float(m4["loss"])) < 1e-5
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_validation_shares_no_play_with_training(tmp_path):
    cfg = tiny(tmp_path).data
    corpus = prepare(cfg)
    train, val = (corpus.stream(s).tokens().tobytes() for s in ("train", "val"))
    assert cfg.val_docs == ("hamlet", "tempest", "julius_caesar")
    for line in (b"Nay, answer me: stand, and unfold yourself.", b"Friends, Romans, countrymen",
                 b"We are such stuff\nAs dreams are made on"):
        assert line in val and line not in train  # also absent from the First Folio copies we skip


def test_packing_gives_segments_and_masks_the_end_byte():
    x = np.array([[65, 66, 0, 67, 0, 68]])
    np.testing.assert_array_equal(segment_ids(x), [[0, 0, 0, 1, 1, 2]])


def test_half_written_checkpoint_is_skipped(tmp_path):
    cfg = tiny(tmp_path, steps=10, sample_tokens=0)
    run(cfg, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    broken = ckpts / "20"
    import shutil
    shutil.copytree(ckpts / "10", broken)
    for f in (broken / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    with pytest.warns(UserWarning, match="checkpoints/20 fails its checksums: params/.* bytes"):
        _, _, step = load_model(tmp_path / "run")
    assert step == 10 and len(list((tmp_path / "run" / "checkpoints.unreadable").iterdir())) == 1  # kept


def test_bad_input_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="data.corpus: '/nonexistent'"):
        run(from_dict({**to_dict(tiny(tmp_path)), "data": {"corpus": "/nonexistent"}}), tmp_path / "a")
    with pytest.raises(ValueError, match="data.val_docs"):
        run(from_dict({**to_dict(tiny(tmp_path)), "data": {"val_docs": ["hamlet_gut_f"]}}), tmp_path / "a")
    run(tiny(tmp_path, steps=2, sample_tokens=0), tmp_path / "b")
    other = to_dict(tiny(tmp_path, steps=2))
    other["model"]["d_model"] = 64
    with pytest.raises(ValueError, match=r"config differs \(model.d_model: 32 there, 64 now\)"):
        run(from_dict(other), tmp_path / "b")
    assert not (tmp_path / "a").exists()


def test_nonfinite_loss_stops_naming_the_step(tmp_path):
    lines = []
    with pytest.raises(SystemExit) as e:
        run(tiny(tmp_path, lr=1e30, warmup_steps=0, grad_clip=0.0), tmp_path / "run", log=lines.append)
    assert e.value.code == 1 and any("non-finite" in line and "step" in line for line in lines)
    assert "non-finite gradient of blocks.0.ffn.w_down, " in lines[-1], lines[-1]  # the leaves, by name
    skipped = run(tiny(tmp_path, lr=1e30, warmup_steps=0, grad_clip=0.0, on_nonfinite="skip", steps=6,
                       sample_tokens=0), tmp_path / "skip", log=lambda _: None)
    assert skipped["skipped"] >= 1


def _train_cmd(tmp_path, run_dir, **train):
    train = {"steps": 40, "log_every": 1, "eval_every": 20, "checkpoint_every": 5, "sample_tokens": 0, **train}
    cfg = to_dict(tiny(tmp_path, run_dir=str(run_dir), **train))
    path = tmp_path / f"{Path(run_dir).name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "train", str(path)]


def _wait_for_step(run_dir, step, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        path = Path(run_dir) / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        assert proc.poll() is None, "training ended before the step to interrupt"
        time.sleep(0.05)
    raise TimeoutError


DETERMINISTIC = ("step", "tokens", "loss", "lr", "grad_norm", "val_loss")


def test_sigterm_writes_a_checkpoint_before_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = _train_cmd(tmp_path, tmp_path / "run", steps=10 ** 6, checkpoint_every=10 ** 6, eval_every=10 ** 6)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(tmp_path / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    step = int(out.split("checkpoint of step ")[1].split()[0])
    assert step >= 3 and (tmp_path / "run" / "checkpoints" / str(step)).is_dir()


def test_performer_features_are_redrawn_as_a_function_of_step(tmp_path):
    from train.step import redraw_features

    cfg = from_dict({"model": {"d_model": 32, "num_layers": 1, "mixer": {"kind": "linear_attention",
                                                                         "feature_map": "performer"}}})
    graphdef, params, rest = nnx.split(LanguageModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    a = redraw_features(graphdef, params, rest, jax.random.key(5))
    b = redraw_features(graphdef, params, rest, jax.random.key(5))
    c = redraw_features(graphdef, params, rest, jax.random.key(6))
    leaves = lambda s: jax.tree.leaves(nnx.to_pure_dict(s))  # noqa: E731
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(rest)))


def test_weight_decay_skips_norms_biases_embeddings_and_ssm_decays():
    cfg = from_dict({"model": {"d_model": 32, "num_layers": 1, "mixer": {"kind": "mamba", "state_size": 4}}})
    params = nnx.to_pure_dict(nnx.state(LanguageModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param))
    flags = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(optim.decays(params))}
    decayed = {k for k, v in flags.items() if v}
    assert any("in_proj" in k or "out_proj" in k for k in decayed) and any("w_up" in k for k in decayed)
    assert not any(name in k for k in decayed for name in ("embed", "norm", "A_log", "dt_bias", "'D'", "bias"))
