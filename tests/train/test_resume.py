"""Runs never lose work and bad input never passes silently (train/resume.py, zoo/checkpoint.py):
each case as a user meets it, asserting the message names what is wrong and that no checkpoint or
metrics line was lost. The fault test kills a run at random moments, checkpoint writes and metrics
appends included, and checks the resumed run is bitwise the uninterrupted one."""

import json
import os
import random
import shutil
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

from tests.train.test_train import DETERMINISTIC, ROOT, metrics, tiny
from train.loop import run
from zoo.checkpoint import load_model
from zoo.config import from_dict, to_dict

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def quiet():
    lines = []
    return lines, lines.append


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 10-step run with checkpoints at 5 and 10 (its folder is copied, never changed)."""
    root = tmp_path_factory.mktemp("finished")
    cfg = tiny(root, steps=10, checkpoint_every=5, keep_checkpoints=3, sample_tokens=0, eval_every=10)
    run(cfg, root / "run", log=lambda _: None)
    return cfg, root / "run"


def copy_of(finished, tmp_path, **train):
    cfg, src = finished
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    data = to_dict(cfg)
    data["train"].update(run_dir=str(dst), **train)
    return from_dict(data), dst


def snapshot(run_dir: Path) -> dict:
    """Every file of the run folder -> its bytes: what a refused resume must leave untouched."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("change, named", [
    ({"lr": 0.3}, "train.lr: 0.01 there, 0.3 now"),
    ({"grad_clip": 0.0}, "train.grad_clip: 1.0 there, 0.0 now"),
    ({"steps": 5}, "train.steps: 10 there, 5 now"),
])
def test_a_resume_that_changes_the_run_is_refused_by_name_and_loses_nothing(finished, tmp_path, change, named):
    cfg, run_dir = copy_of(finished, tmp_path, **change)
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match="--allow-config-change") as e:
        run(cfg, run_dir, log=lambda _: None)
    assert named in str(e.value)
    assert snapshot(run_dir) == before


def test_allowed_changes_are_printed_and_the_old_config_is_kept(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path, steps=12, lr=0.02, log_every=1)
    lines, log = quiet()
    last = run(cfg, run_dir, log=log, allow_config_change=True)
    assert last["step"] == 12 and any("train.lr: 0.01 -> 0.02" in line for line in lines)
    assert any("train.log_every: 5 -> 1" in line for line in lines)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == 0.02
    assert yaml.safe_load((run_dir / "config.before-step10.yaml").read_text())["train"]["lr"] == 0.01
    assert [r["step"] for r in metrics(run_dir)][:2] == [5, 10]  # the finished part is kept


def test_an_optimiser_state_that_cannot_follow_is_an_error_naming_the_key(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path, grad_clip=0.0)
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"intact but do not fit .*train.grad_clip: 1.0 there, 0.0 now"):
        run(cfg, run_dir, log=lambda _: None, allow_config_change=True)
    assert {k: v for k, v in snapshot(run_dir).items() if not k.startswith("config")} == \
        {k: v for k, v in before.items() if not k.startswith("config")}


def test_harmless_changes_resume_and_a_finished_run_says_so(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path, eval_every=3, keep_checkpoints=1)
    lines, log = quiet()
    last = run(cfg, run_dir, log=log)
    assert any("is finished: its checkpoint is step 10 of train.steps=10" in line for line in lines)
    assert last["step"] == 10 and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["10"]


def test_keys_added_since_a_run_was_made_read_as_their_defaults(finished, tmp_path, monkeypatch):
    """A run made by an older version has no entry for a config key added since (its default keeps
    what the run computed): it resumes, not refused as changed."""
    import train.resume as resume
    cfg, run_dir = copy_of(finished, tmp_path)
    newest = resume.newest_meta

    def older(mngr):
        meta = newest(mngr)
        for section, key in (("model", "norm"), ("model", "embed_norm"), ("train", "stop_at_accuracy")):
            del meta["config"][section][key]
        return meta

    monkeypatch.setattr(resume, "newest_meta", older)
    lines, log = quiet()
    assert run(cfg, run_dir, log=log)["step"] == 10
    changes = [line for line in lines if line.startswith("config change")]
    assert changes and not any("norm" in line or "stop_at_accuracy" in line for line in changes), changes


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_run_carries_on(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path)
    victim = next(p for p in (run_dir / "checkpoints" / "10" / "opt_state").rglob("*") if p.is_file())
    victim.unlink()
    lines, log = quiet()
    with pytest.warns(UserWarning, match=rf"checkpoints/10 fails its checksums: opt_state/.*{victim.name} is missing"):
        last = run(cfg, run_dir, log=log)
    assert last["step"] == 10 and any("resumed from" in line and line.endswith("/5") for line in lines)
    aside = list((run_dir / "checkpoints.unreadable").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("10-")  # kept, renamed
    assert run(cfg, run_dir, log=lambda _: None)["step"] == 10  # and again: no "already exists"


def test_a_flipped_bit_is_refused_by_name(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path)
    victim = max((p for p in (run_dir / "checkpoints" / "10" / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=rf"checkpoints/10 fails its checksums: .*{victim.name} does not match"):
        run(cfg, run_dir, log=lambda _: None)


def test_a_torn_metrics_line_and_an_emptied_config_do_not_stop_a_resume(finished, tmp_path):
    cfg, run_dir = copy_of(finished, tmp_path, steps=12)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 11, "tok')
    (run_dir / "config.yaml").write_text("")
    lines, log = quiet()
    run(cfg, run_dir, log=log, allow_config_change=True)
    assert any("line 3 is torn" in line for line in lines)
    assert [r["step"] for r in metrics(run_dir)] == [5, 10, 12]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 12


def test_another_corpus_on_a_finished_run_is_refused(finished, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b"):
        (corpus / f"{name}.txt").write_text("hello world, " * 200)
    cfg, run_dir = copy_of(finished, tmp_path)
    data = to_dict(cfg)
    data["data"] = {"corpus": str(corpus), "val_docs": ["b"]}
    with pytest.raises(ValueError, match=r"data.corpus: 'shakespeare' there, '.*corpus' now"):
        run(from_dict(data), run_dir, log=lambda _: None)


def test_run_dir_that_is_a_file_or_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="train.run_dir: .*file is a file, not a folder"):
        run(tiny(tmp_path, steps=1), tmp_path / "file", log=lambda _: None)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anywhere: nothing to refuse
            return
        with pytest.raises(ValueError, match="cannot be written"):
            run(tiny(tmp_path, steps=1), locked / "run", log=lambda _: None)
    finally:
        locked.chmod(0o700)


def test_out_of_range_tokens_and_cache_overflow_are_loud():
    from tests.util import tiny_model

    model = tiny_model()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\) .*got ids from 7 to 300"):
        model(jnp.array([[7, 300]]))
    state = model.init_state(1, 4)
    step = nnx.jit(lambda m, t, s: m.decode(t, s))
    for _ in range(2):  # under jit nothing can raise: 6 tokens into 4 slots sets the flag
        _, state = step(model, jnp.array([[1, 2, 3]]), state)
    assert bool(model.overflowed(state)) and not bool(model.overflowed(model.init_state(1, 4)))


def test_command_line_errors_name_the_field_without_a_traceback(finished, tmp_path):
    """Each error leaves main() as a clean exit with its message (what `python -m` prints to stderr,
    status 1), no other exception; run in this process, unchecked as users run, but for one case
    through `python -m infer` end to end (the kill test below runs `python -m train`)."""
    import infer.__main__
    import train.__main__
    from tests.util import unchecked

    _, run_dir = finished
    cases = [
        (train.__main__, [str(ROOT / "configs" / "transformer.yaml"), "train.grad_clip=-1"],
         "error: train.grad_clip: expected 0 <= grad_clip, got -1"),
        (train.__main__, [str(ROOT / "configs" / "transformer.yaml"), "train.steps=[1"],
         "error: override 'train.steps=[1': the value '[1' is not valid YAML"),
        (infer.__main__, [str(run_dir), "model.d_model=8"],
         "error: overrides model.d_model=8: a run folder is loaded with the config it was trained with"),
        (infer.__main__, [str(run_dir), "--stop", ""],
         "error: stop=['']: expected a non-empty string or a list of them"),
    ]
    for module, argv, message in cases:
        with unchecked(), pytest.raises(SystemExit) as e:
            module.main(argv)
        assert isinstance(e.value.code, str) and message in e.value.code, (module.__name__, argv, e.value.code)
    cmd = [sys.executable, "-m", "infer", str(run_dir), "--top-k", "1000"]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    message = "1 <= top_k <= 256 (the vocabulary)"
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def _cmd(tmp_path, **train):
    cfg = to_dict(tiny(tmp_path, **{"steps": 40, "log_every": 1, "eval_every": 20, "checkpoint_every": 3,
                                    "keep_checkpoints": 2, "sample_tokens": 0, **train}))
    path = tmp_path / f"{Path(train['run_dir']).name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "train", str(path)]


def test_kills_at_random_moments_resume_bitwise_and_keep_the_checkpoint_count(tmp_path):
    """SIGKILL a few times at random moments (checkpoints every 3 steps, metrics every step, so some
    kills land in a checkpoint write or a metrics append), resume each time: the same metrics and
    parameters as a run never stopped, and keep_checkpoints steps left (a half-written step is set
    aside, not counted)."""
    straight = subprocess.Popen(_cmd(tmp_path, run_dir=str(tmp_path / "straight")), cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed, cmd, rng = tmp_path / "killed", _cmd(tmp_path, run_dir=str(tmp_path / "killed")), random.Random()
    for _ in range(3):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        path, deadline = killed / "metrics.jsonl", time.time() + 120
        reached = (json.loads(line)["step"] for line in (path.read_text().splitlines() if path.exists() else []))
        target = max(reached, default=0) + rng.randint(2, 9)
        while time.time() < deadline and proc.poll() is None:
            lines = path.read_text().splitlines() if path.exists() else []
            if any(line.startswith(f'{{"step": {target},') for line in lines):
                time.sleep(rng.uniform(0, 0.3))  # into the next step, a write or an append
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-2000:]
    a, b = metrics(tmp_path / "straight"), metrics(killed)
    assert [[r.get(k) for k in DETERMINISTIC] for r in a] == [[r.get(k) for k in DETERMINISTIC] for r in b]
    assert sorted(int(p.name) for p in (killed / "checkpoints").iterdir()) == [39, 40]
    (_, ma, _), (_, mb, _) = load_model(tmp_path / "straight"), load_model(killed)
    for x, y in zip(jax.tree.leaves(nnx.state(ma)), jax.tree.leaves(nnx.state(mb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
