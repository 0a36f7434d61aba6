"""Every file in configs/ trains through the one loop, at a tiny size, and its loss falls."""

import json
from pathlib import Path

import pytest

from train.loop import run
from zoo import load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
SHRINK = ["model.d_model=64", "model.num_layers=1", "train.steps=12", "train.batch_size=4", "train.seq_len=32",
          "train.lr=1e-2", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=12", "train.eval_batches=1",
          "train.checkpoint_every=12", "train.sample_tokens=0"]
EXITS = ["model.num_layers=2", "model.exits.layers=[1]", "model.exits.weights=[0.5]", "model.exits.classifier_steps=2"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_trains_and_its_loss_falls(path, tmp_path):
    text = path.read_text()
    shrink = [o for o in SHRINK if not o.startswith("model.")] if "init_from:" in text else SHRINK  # its own shapes
    lines = []
    try:
        run(load_config(path, shrink + (EXITS if "exits:" in text else [])), tmp_path, log=lines.append)
    except SystemExit:
        pytest.fail("\n".join(lines))  # a non-finite step: the loop's message names the step and the gradients
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
