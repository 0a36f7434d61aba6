"""KL-guided hybrid selection (train/hybrid.py): on a constructed student whose layer 1 alone is far
from its teacher, restoring layer 1 lowers the KL most and is the layer kept; restoring a layer that is
already the teacher's changes nothing; the command runs on a converted run."""

import jax.numpy as jnp
import numpy as np

from tests.util import tiny_model
from train.convert import convert
from train.hybrid import choose, restoration_kl


def test_the_layer_that_matters_most_is_the_one_kept():
    teacher = tiny_model({"kind": "attention", "num_heads": 2}, num_layers=3)
    student, _ = convert(teacher, {"kind": "deltanet", "num_heads": 2}, layers=[0, 1, 2])
    o = student.blocks[1].mixer.o_proj.kernel
    o.set_value(o.get_value() * 30)  # layer 1's mixer far from the attention it replaced
    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32), "mask": jnp.ones((2, 16))}
               for _ in range(2)]
    kl = restoration_kl(student, teacher, [0, 1, 2], batches)
    assert kl[1] < min(kl[0], kl[2]) and kl[1] < kl[None], kl
    assert choose(kl, 1) == [1] and len(choose(kl, 2)) == 2

    same, _ = convert(teacher, {"kind": "attention", "num_heads": 2}, layers=[0])
    kl_same = restoration_kl(same, teacher, [0], batches[:1])
    assert abs(kl_same[None]) < 1e-6 and abs(kl_same[0]) < 1e-6  # the teacher itself, restored or not


def test_the_command_runs_on_a_converted_run(tmp_path, capsys):
    import json

    import yaml

    from train.hybrid import main
    from train.loop import run
    from zoo import load_config

    small = {"steps": 2, "batch_size": 2, "seq_len": 16, "warmup_steps": 0, "eval_every": 2, "eval_batches": 1,
             "sample_tokens": 0, "checkpoint_every": 2}
    (tmp_path / "teacher.yaml").write_text(yaml.safe_dump({
        "model": {"d_model": 32, "num_layers": 2, "mixer": {"kind": "attention", "num_heads": 2}}, "train": small}))
    run(load_config(tmp_path / "teacher.yaml"), tmp_path / "teacher", log=lambda _: None)
    convert = {"mixer": {"kind": "deltanet", "num_heads": 2}}
    (tmp_path / "student.yaml").write_text(yaml.safe_dump({
        "train": {**small, "distill": {"teacher": str(tmp_path / "teacher"), "convert": convert}}}))
    run(load_config(tmp_path / "student.yaml"), tmp_path / "student", log=lambda _: None)
    main([str(tmp_path / "student"), "--keep", "1", "--batches", "1", "--batch-size", "2"])
    out = json.loads((tmp_path / "student" / "hybrid.json").read_text())
    assert len(out["keep"]) == 1 and sorted(out["keep"] + out["convert_layers"]) == [0, 1]
    assert [r["restored"] for r in out["kl"]] == [None, 0, 1]
    assert "keep as attention" in capsys.readouterr().out
