"""Length extrapolation (train/extrapolate.py): at 1x it reproduces the training loop's own
evaluation (text: the loss of the same validation windows; task: the accuracy on the same test
set), and longer factors report one loss per bucket of the trained length."""

import pytest

from train.extrapolate import extrapolate, main
from train.loop import run
from zoo.checkpoint import load_model
from zoo.config import from_dict

TINY = {"d_model": 16, "num_layers": 1, "mixer": {"kind": "gla", "num_heads": 1}}
TRAIN = {"steps": 3, "batch_size": 8, "seq_len": 16, "eval_every": 3, "eval_batches": 2, "sample_tokens": 0}


def test_text_run(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    last = run(from_dict({"model": TINY, "train": TRAIN}), tmp_path / "text", log=lambda *a: None)
    cfg, model, _ = load_model(tmp_path / "text")
    rows = extrapolate(model, cfg, (1, 3), batches=2)
    assert rows[0]["loss_per_bucket"][0] == pytest.approx(last["val_loss"], rel=1e-5)
    assert len(rows[1]["loss_per_bucket"]) == 3 and rows[1]["tokens"] == 48 and rows[0]["ratio"] == 1.0
    main([str(tmp_path / "text"), "--factors", "1", "--batches", "1"])
    assert (tmp_path / "text" / "extrapolation.json").exists()


def test_task_run(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    task = {"kind": "mqar", "vocab_size": 32, "num_kv_pairs": 2, "num_train_examples": 64, "num_test_examples": 16}
    last = run(from_dict({"model": TINY, "data": {"task": task}, "train": TRAIN}), tmp_path / "task",
               log=lambda *a: None)
    cfg, model, _ = load_model(tmp_path / "task")
    rows = extrapolate(model, cfg, (1, 2), batches=2)
    assert rows[0]["accuracy"] == pytest.approx(last["val_accuracy"], abs=1e-4) and rows[1]["tokens"] == 32


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit, match="not a run folder"):
        main([str(tmp_path / "missing")])
