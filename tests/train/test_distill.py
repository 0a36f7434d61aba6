"""Distillation through the loop (train/distill.py, `train.distill`): the KL and the mixed loss equal
direct computations; a student of another kind distilled from a trained teacher moves toward it
(its KL falls) and the teacher is untouched; a killed distillation resumes bitwise, a changed teacher
is refused by name on resume; bad teachers are refused before any work."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.util import tiny_model
from train.distill import kl_per_token
from train.loop import run
from train.step import forward
from zoo.checkpoint import load_model
from zoo.config import ConvertConfig, DistillConfig, from_dict


def test_kl_and_the_mixed_loss_equal_direct_computations():
    rng = np.random.default_rng(0)
    s, t = rng.standard_normal((2, 3, 7)), rng.standard_normal((2, 3, 7))
    for temp in (1.0, 2.5):
        ps, pt = (np.exp(a / temp) / np.exp(a / temp).sum(-1, keepdims=True) for a in (s, t))
        direct = (pt * (np.log(pt) - np.log(ps))).sum(-1)
        np.testing.assert_allclose(kl_per_token(jnp.asarray(s), jnp.asarray(t), temp), direct, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kl_per_token(jnp.asarray(t), jnp.asarray(t)), 0, atol=1e-6)

    model = tiny_model({"kind": "gla", "num_heads": 2}, num_layers=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jnp.asarray(rng.integers(0, 256, (2, 9)), jnp.int32)
    batch = {"x": x[:, :-1], "y": x[:, 1:], "mask": jnp.asarray(rng.random((2, 8)) < 0.8, jnp.float32)}
    teacher = jnp.asarray(rng.standard_normal((2, 8, 256)), jnp.float32)
    d = DistillConfig(teacher="t", temperature=2.0, lm_weight=0.3)
    loss_sum, count, *_, metrics, _ = jax.jit(lambda p, r, b, t: forward(graphdef, p, r, b, False, t, d))(
        params, rest, batch, teacher)
    logits = jax.jit(lambda m, x: m(x))(model, batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    kl = kl_per_token(logits, teacher, 2.0)
    want = jnp.sum((0.3 * ce + 0.7 * 4.0 * kl) * batch["mask"])
    np.testing.assert_allclose(float(loss_sum), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["distill_kl"]), float(jnp.sum(kl * batch["mask"]) / count), rtol=1e-5)


def test_the_alignment_loss_is_each_converted_mixer_on_the_teachers_stream():
    from train.convert import convert
    from train.distill import teacher_targets

    teacher = tiny_model({"kind": "attention", "num_heads": 2}, num_layers=2)
    student, _ = convert(teacher, {"kind": "deltanet", "num_heads": 2})  # both layers: the student's own
    # stream into layer 1 (through its DeltaNet) is not the teacher's, which the loss must use
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 256, (2, 9)), jnp.int32)
    batch = {"x": x, "y": x, "mask": jnp.asarray(rng.random((2, 9)) < 0.8, jnp.float32)}
    d = DistillConfig(teacher="t", convert=ConvertConfig(), trainable="converted", stage="layers")
    graphdef, params, rest = nnx.split(student, nnx.Param, ...)

    @jax.jit
    def both(teacher, params):
        targets = teacher_targets(*nnx.split(teacher, nnx.Param, ...), batch, d)
        x0 = teacher.embed_tokens(batch["x"])
        direct = jnp.float32(0)
        for i, x in enumerate((x0, teacher.blocks[0](x0)[0])):  # the teacher's stream entering each layer
            want = teacher.blocks[i].mixer(teacher.blocks[i].mixer_norm(x))
            got = student.blocks[i].mixer(student.blocks[i].mixer_norm(x))
            direct = direct + jnp.sum(jnp.mean(jnp.square(got - want), axis=-1) * batch["mask"])
        return forward(graphdef, params, rest, batch, True, targets, d), direct

    (loss_sum, count, _, _, metrics, _), direct = both(teacher, params)
    np.testing.assert_allclose(float(loss_sum), float(direct), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["distill_mse"]), float(direct / (2 * count)), rtol=1e-5)
    assert float(direct) > 0


def _config(run_dir, mixer, steps, distill=None, **train):
    return from_dict({"model": {"d_model": 32, "num_layers": 1, "mixer": mixer},
                      "train": {"steps": steps, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "warmup_steps": 2,
                                "log_every": 1, "eval_every": steps, "eval_batches": 1, "checkpoint_every": 4,
                                "sample_tokens": 0, "run_dir": str(run_dir), "distill": distill, **train}})


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher") / "run"
    run(_config(folder, {"kind": "attention", "num_heads": 2}, 40, lr=1e-2), folder, log=lambda _: None)
    return folder


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_student_of_another_kind_moves_toward_its_teacher_and_resumes_bitwise(teacher, tmp_path):
    before = jax.tree.map(np.asarray, nnx.state(load_model(teacher)[1], nnx.Param))
    distill = {"teacher": str(teacher), "temperature": 2.0}
    cfg = _config(tmp_path / "student", {"kind": "gla", "num_heads": 2}, 12, distill)
    run(cfg, tmp_path / "student", log=lambda _: None)
    kl = [r["distill_kl"] for r in _rows(tmp_path / "student")]
    assert len(kl) == 12 and np.mean(kl[-3:]) < np.mean(kl[:3]) * 0.8, kl
    after = jax.tree.map(np.asarray, nnx.state(load_model(teacher)[1], nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))

    # killed after its step-8 checkpoint (the step-12 one gone), resumed: the run that was never stopped
    shutil.copytree(tmp_path / "student", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "12")
    run(cfg, tmp_path / "resumed", log=lambda _: None)
    straight, resumed = (load_model(tmp_path / d)[1] for d in ("student", "resumed"))
    for a, b in zip(*(jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (straight, resumed)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    other = _config(tmp_path / "student", {"kind": "gla", "num_heads": 2}, 12,
                    {**distill, "teacher": str(tmp_path / "resumed")})
    with pytest.raises(ValueError, match=r"train\.distill\.teacher"):
        run(other, tmp_path / "student", log=lambda _: None)


def test_bad_teachers_are_refused_before_any_work(teacher, tmp_path):
    gla = {"kind": "gla", "num_heads": 2}
    with pytest.raises(ValueError, match=r"train\.distill\.teacher: expected a run folder"):
        _config(tmp_path / "a", gla, 2, {"temperature": 2.0})
    with pytest.raises(ValueError, match=r"train\.distill\.trainable: 'converted' trains the layers"):
        _config(tmp_path / "a", gla, 2, {"teacher": str(teacher), "trainable": "converted"})
    with pytest.raises(ValueError, match=r"train\.distill\.stage: 'layers' trains the converted mixers alone"):
        _config(tmp_path / "a", gla, 2, {"teacher": str(teacher), "stage": "layers"})
    with pytest.raises(ValueError, match="is not a run folder with checkpoints .* nor a Hugging Face model folder"):
        run(_config(tmp_path / "b", gla, 2, {"teacher": str(tmp_path)}), tmp_path / "b", log=lambda _: None)
    small = from_dict({"model": {"d_model": 32, "num_layers": 1, "mixer": gla, "vocab_size": 32},
                       "data": {"task": {"kind": "mqar", "vocab_size": 32, "num_kv_pairs": 2}},
                       "train": {"steps": 2, "batch_size": 4, "seq_len": 16, "distill": {"teacher": str(teacher)}}})
    with pytest.raises(ValueError, match="vocabulary of 256 tokens and the model 32"):
        run(small, tmp_path / "c", log=lambda _: None)
    assert not (tmp_path / "c" / "checkpoints").exists()


def test_a_converted_student_starts_from_its_teacher(teacher, tmp_path):
    """train.distill.convert: the model is the teacher's with layer 0 a DeltaNet, started from the teacher's
    weights (its attention's projections in the DeltaNet's), then distilled."""
    import yaml

    from zoo import load_config

    section = {"teacher": str(teacher), "convert": {"mixer": {"kind": "deltanet", "num_heads": 2}, "layers": [0]}}
    path = tmp_path / "student.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 2, "batch_size": 4, "seq_len": 32, "lr": 1e-12,
                                              "warmup_steps": 0, "eval_every": 2, "eval_batches": 1,
                                              "sample_tokens": 0, "distill": section}}))
    cfg = load_config(path)
    assert cfg.model.mixers()[0].KIND == "deltanet" and cfg.model.d_model == 32
    logged = []
    run(cfg, tmp_path / "run", log=logged.append)
    assert any("parameters taken from the teacher" in str(line) for line in logged), logged
    t, s = load_model(teacher)[1], load_model(tmp_path / "run")[1]
    near = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-8)  # lr 1e-12: barely moved
    near(s.embed.embedding.get_value(), t.embed.embedding.get_value())
    near(s.blocks[0].ffn.w_up.get_value(), t.blocks[0].ffn.w_up.get_value())
    near(s.blocks[0].mixer.q_proj.kernel.get_value(), t.blocks[0].mixer.wq.get_value().reshape(32, -1))

    # trainable: converted: the DeltaNet moves, everything else stays the teacher's, bit for bit
    frozen = yaml.safe_load(path.read_text())
    frozen["train"].update(lr=1e-2, distill={**section, "trainable": "converted"})
    path.write_text(yaml.safe_dump(frozen))
    run(load_config(path), tmp_path / "frozen", log=lambda _: None)
    s = load_model(tmp_path / "frozen")[1]
    flat = lambda m: {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    student, source = flat(s), flat(t)
    for key, value in student.items():
        if key[:3] != ("blocks", 0, "mixer"):
            np.testing.assert_array_equal(value, source[key], err_msg=str(key))
    assert not np.allclose(student[("blocks", 0, "mixer", "q_proj", "kernel")], source[("blocks", 0, "mixer", "wq")
                                                                                        ].reshape(32, -1))

    # stage layers (attention transfer): the DeltaNet alone learns the attention's outputs
    frozen["train"].update(steps=8, log_every=1, eval_every=8, distill={**section, "trainable": "converted",
                                                                          "stage": "layers"})
    path.write_text(yaml.safe_dump(frozen))
    run(load_config(path), tmp_path / "layers", log=lambda _: None)
    mse = [r["distill_mse"] for r in _rows(tmp_path / "layers")]
    assert len(mse) == 8 and mse[-1] < 0.7 * mse[0], mse

    # then stage logits from those weights (start_from), not the teacher's; another model is refused
    frozen["train"].update(steps=2, lr=1e-12, distill={**section, "start_from": str(tmp_path / "layers")})
    path.write_text(yaml.safe_dump(frozen))
    run(load_config(path), tmp_path / "logits", log=lambda _: None)
    near(load_model(tmp_path / "logits")[1].blocks[0].mixer.q_proj.kernel.get_value(),
         load_model(tmp_path / "layers")[1].blocks[0].mixer.q_proj.kernel.get_value())
    frozen["train"]["distill"]["start_from"] = str(teacher)
    path.write_text(yaml.safe_dump(frozen))
    with pytest.raises(ValueError, match=r"train\.distill\.start_from: .* holds another model than this run's"):
        run(load_config(path), tmp_path / "wrong", log=lambda _: None)

    raw = from_dict({"train": {"steps": 2, "batch_size": 4, "seq_len": 32, "distill": section}})  # not derived
    with pytest.raises(ValueError, match="the model section is not the teacher's with the converted layers"):
        run(raw, tmp_path / "raw", log=lambda _: None)
    path.write_text(yaml.safe_dump({"model": {"d_model": 64}, "train": {"distill": section}}))
    with pytest.raises(ValueError, match="model: with train.distill.convert the model is the teacher's"):
        load_config(path)
    path.write_text(yaml.safe_dump({"train": {"distill": {**section, "teacher": str(tmp_path)}}}))
    with pytest.raises(ValueError, match=r"train\.distill\.teacher: .* is not a run folder \(no config\.yaml\)"):
        load_config(path)


def test_a_teachers_generations_make_a_corpus_the_pipeline_reads(teacher, tmp_path, monkeypatch):
    """Sequence-level distillation: write_corpus's documents are the prompt and generate_text's sample, and
    a run's data section reads the folder as a corpus."""
    import infer
    from train.distill import main
    from train.prepare import prepare
    from zoo import tokenizer

    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    main([str(teacher), "--out", str(tmp_path / "corpus"), "--docs", "3", "--tokens", "12", "--batch-size", "2",
          "--prompt", "AB", "--prompt", "C", "--top-k", "20"])
    files = sorted((tmp_path / "corpus").glob("*.txt"))
    assert [f.name for f in files] == ["doc000000.txt", "doc000001.txt", "doc000002.txt"]
    model = load_model(teacher)[1]
    want = infer.generate_text(model, ["AB", "C"], max_new_tokens=12, tokenizer=tokenizer.Bytes, seed=0,
                               sampling=infer.Sampling(1.0, top_k=20))
    assert [f.read_text() for f in files[:2]] == ["AB" + want[0], "C" + want[1]]
    assert files[2].read_text().startswith("AB")
    cfg = from_dict({"data": {"corpus": str(tmp_path / "corpus"), "val_docs": ["doc000002"]}})
    prepared = prepare(cfg.data, lambda _: None)
    assert prepared.meta["splits"]["train"]["docs"] == 2
    assert len(prepared.stream("val")) == len(files[2].read_bytes()) + 1  # its bytes and the end token
    with pytest.raises(ValueError, match="write_corpus: docs=0"):
        main([str(teacher), "--out", str(tmp_path / "none"), "--docs", "0"])


def test_lora_in_the_loop_trains_only_the_adapters_resumes_bitwise_and_loads_as_plain_weights(teacher, tmp_path):
    """train.lora on a distillation that starts from the teacher's weights: every parameter but the
    adapters stays the teacher's bit for bit (the adapted weights' bases too); load_model folds the
    adapters in and gives the adapted model's logits; a killed run resumes bitwise; bad input is refused."""
    from tests.util import assert_close
    from tests.util import forward as full_pass
    from train.loop import _init_or_restore
    from zoo.sharding import make_mesh

    attention = {"kind": "attention", "num_heads": 2}
    distill = {"teacher": str(teacher), "start_from": str(teacher), "temperature": 2.0, "lm_weight": 0.5}
    lora = {"rank": 2, "alpha": 4.0, "targets": r"mixer\.(wq|wv)$"}
    cfg = _config(tmp_path / "lora", attention, 8, distill, lora=lora, lr=1e-2)
    run(cfg, tmp_path / "lora", log=lambda _: None)
    assert len(_rows(tmp_path / "lora")) == 8

    flat = lambda model: {"/".join(map(str, p)): np.asarray(v) for p, v in
                          nnx.to_flat_state(nnx.state(model, nnx.Param)) for v in [v.get_value()]}
    before, (_, merged, _) = flat(load_model(teacher)[1]), load_model(tmp_path / "lora")
    after = flat(merged)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {"blocks/0/mixer/wq", "blocks/0/mixer/wv"}, moved

    mesh = make_mesh(cfg.train.mesh)
    with jax.set_mesh(mesh):
        state, checkpoints, step = _init_or_restore(cfg, tmp_path / "lora", mesh, lambda _: None, None)
    checkpoints.close()
    adapted = state.model()
    assert step == 8
    np.testing.assert_array_equal(np.asarray(adapted.blocks[0].mixer.wq.get_value().base),
                                  before["blocks/0/mixer/wq"])  # the base is the teacher's, untouched
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 19)), jnp.int32)
    assert_close(full_pass(merged, tokens), full_pass(adapted, tokens), 1e-5, "folded vs adapted")

    shutil.copytree(tmp_path / "lora", tmp_path / "resumed")  # killed after its step-4 checkpoint
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
    run(cfg, tmp_path / "resumed", log=lambda _: None)
    resumed = flat(load_model(tmp_path / "resumed")[1])
    assert all(np.array_equal(after[k], resumed[k]) for k in after)

    with pytest.raises(ValueError, match=r"train\.lora\.targets: '\(' is not a regular expression"):
        _config(tmp_path / "a", attention, 2, distill, lora={"targets": "("})
    with pytest.raises(ValueError, match=r"train\.lora: adapters train in place of the weights"):
        _config(tmp_path / "a", attention, 2, {**distill, "convert": {"mixer": {"kind": "gla"}},
                                               "trainable": "converted"}, lora={})
    with pytest.raises(ValueError, match=r"add_lora: targets='nothing' matches no projection"):
        run(_config(tmp_path / "b", attention, 2, distill, lora={"targets": "nothing"}), tmp_path / "b",
            log=lambda _: None)
