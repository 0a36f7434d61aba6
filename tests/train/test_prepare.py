"""The prepare step (train/prepare.py, train/corpus.py) and training from its shards: shards read as
the in-memory stream did, bitwise in losses; a SIGKILLed prepare leaves nothing a run would read as
complete and a rerun finishes it; resume on shards is exact; a trained BPE gives back every training
document; bad input is refused by name or skipped and counted. Tiny corpora written in tmp_path."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.train.test_train import DETERMINISTIC, ROOT, metrics, tiny
from train import prepare as prepare_module
from train.data import Stream
from train.loop import run
from train.prepare import prepare
from zoo import tokenizer as tokenizer_lib
from zoo.config import from_dict, to_dict

WORDS = "the quick brown fox jumps over lazy dogs while seven wizards hum a quiet tune".split()


def write_corpus(folder, n=8, words=400, seed=0):
    """n .txt documents of random words in paragraphs; returns name -> text."""
    rng, docs = np.random.default_rng(seed), {}
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        paragraphs = [" ".join(rng.choice(WORDS, words // 4)) for _ in range(4)]
        docs[f"doc{i}"] = "\n\n".join(paragraphs) + "\n"
        (folder / f"doc{i}.txt").write_text(docs[f"doc{i}"])
    return docs


def data(folder, **keys):
    return {"corpus": str(folder), "val_docs": ["doc1", "doc5"], "shard_mb": 0.0005, **keys}


def config(tmp_path, corpus, run_dir, **train):
    cfg = to_dict(tiny(tmp_path, steps=4, checkpoint_every=2, eval_every=4, sample_tokens=0, **train))
    cfg["data"] = data(corpus, packing=True)
    cfg["train"]["run_dir"] = str(run_dir)
    return from_dict(cfg)


@pytest.fixture(scope="module")
def shard_run(tmp_path_factory):
    """A 4-step packed run on a corpus of several shards (windows cross shard ends), checkpoints at 2, 4."""
    root = tmp_path_factory.mktemp("shards")
    docs = write_corpus(root / "corpus")
    cfg = config(root, root / "corpus", root / "run")
    run(cfg, root / "run", log=lambda _: None)
    return cfg, docs, root


def test_shards_read_as_the_in_memory_stream_bitwise_in_losses(shard_run, tmp_path, monkeypatch):
    cfg, docs, root = shard_run
    corpus = prepare(cfg.data, log=lambda _: None)
    assert len(corpus.stream("train").shards) > 3  # several shards: windows span their ends
    expected = {"train": [t for n, t in sorted(docs.items()) if n not in ("doc1", "doc5")],
                "val": [docs["doc1"], docs["doc5"]]}
    in_memory = {s: np.frombuffer("".join(p.strip("\n") + "\0" for t in texts for p in t.split("\n\n") if p.strip())
                                  .encode(), np.uint8) for s, texts in expected.items()}  # the byte path's stream
    for s in ("train", "val"):
        np.testing.assert_array_equal(corpus.stream(s).tokens(), in_memory[s])
    monkeypatch.setattr(prepare_module.Prepared, "stream", lambda self, s: Stream([in_memory[s]]))
    run(config(tmp_path, root / "corpus", tmp_path / "run"), tmp_path / "run", log=lambda _: None)
    a, b = metrics(root / "run"), metrics(tmp_path / "run")
    assert [{k: r.get(k) for k in DETERMINISTIC} for r in a] == [{k: r.get(k) for k in DETERMINISTIC} for r in b]
    assert a[-1]["val_bpb"] == a[-1]["val_loss"] / math.log(2)  # bytes: one token per byte


def test_resume_on_shards_is_bitwise_the_uninterrupted_run(shard_run, tmp_path):
    cfg, _, root = shard_run
    shutil.copytree(root / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")  # as if stopped after step 2's checkpoint
    data = to_dict(cfg)
    data["train"]["run_dir"] = str(tmp_path / "run")
    lines = []
    run(from_dict(data), tmp_path / "run", log=lines.append)
    assert any("resumed from" in line and line.endswith("/2") for line in lines)
    keep = lambda rows: [{k: r.get(k) for k in DETERMINISTIC} for r in rows]
    assert keep(metrics(tmp_path / "run")) == keep(metrics(root / "run"))


def test_sigkill_during_prepare_leaves_nothing_complete_and_a_rerun_finishes(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", n=6, words=200)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": data(tmp_path / "corpus", workers=1)}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZOO_CACHE": str(tmp_path / "cache"), "ZOO_PREPARE_SLEEP": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "train.prepare", str(cfg_file)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not list((tmp_path / "cache").glob("*/unit-00000.json")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder, = (tmp_path / "cache").iterdir()
    assert not (folder / "meta.json").exists()  # nothing a run would read as complete
    assert len(list(folder.glob("unit-*.json"))) == 1
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    lines = []
    cfg = from_dict({"data": data(tmp_path / "corpus")})
    finished = prepare(cfg.data, log=lines.append)
    assert finished.folder == folder and any("1 shards already there" in line for line in lines)
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "fresh"))
    fresh = prepare(cfg.data, log=lambda _: None)
    for s in ("train", "val"):
        np.testing.assert_array_equal(finished.stream(s).tokens(), fresh.stream(s).tokens())
    again = []
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    prepare(cfg.data, log=again.append)
    assert again == []  # the second run starts at once, from the cache


def test_bpe_round_trips_every_training_document_and_a_run_uses_it(tmp_path, capsys):
    docs = write_corpus(tmp_path / "corpus", n=4)
    odd = ("Ünïcödé — ✓ 日本語 🦊\r\n\ttabs  and  spaces, a NUL \x00 and a literal <|endoftext|> inside.\n\n"
           "  leading spaces\n")
    (tmp_path / "corpus" / "odd.txt").write_text(odd)
    lines = [{"text": "json line one 🦊"}, {"text": "<|endoftext|> twice <|endoftext|>"}, {"id": 3, "text": ""}]
    (tmp_path / "corpus" / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = to_dict(tiny(tmp_path, steps=2, eval_every=2, checkpoint_every=2, sample_tokens=3))
    cfg["model"].pop("vocab_size", None)
    cfg["data"] = data(tmp_path / "corpus", val_docs=["doc1"], tokenizer={"kind": "bpe", "vocab_size": 300})
    cfg = from_dict(cfg)
    assert cfg.model.vocab_size == 300  # follows the tokenizer
    corpus = prepare(cfg.data, log=lambda _: None)
    encoder = tokenizer_lib.document_encoder(corpus.folder / "tokenizer.json")
    training = [docs[n] for n in ("doc0", "doc2", "doc3")] + [r["text"] for r in lines] + [odd]
    for text in training:
        assert encoder.decode(encoder.encode(text, add_special_tokens=False).ids) == text
    stream = corpus.stream("train").tokens()
    assert corpus.eod == 0 and stream.dtype == np.uint16 and stream.max() < 300
    assert (stream == 0).sum() == len(training)  # the end token only between documents, never from text
    run(cfg, tmp_path / "run", log=lambda _: None)
    last = metrics(tmp_path / "run")[-1]
    assert last["val_bpb"] == pytest.approx(last["val_loss"] * corpus.tokens_per_byte() / math.log(2))
    assert corpus.tokens_per_byte() < 0.9  # BPE: fewer tokens than bytes
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (corpus.folder / "tokenizer.json").read_bytes()
    from infer.__main__ import main as infer_main
    capsys.readouterr()
    infer_main([str(tmp_path / "run"), "--prompt", "the quick", "--max-new-tokens", "3", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("the quick")


def test_bad_input_is_refused_by_name_or_skipped_and_counted(tmp_path):
    write_corpus(tmp_path / "c", n=3)
    (tmp_path / "c" / "latin.txt").write_bytes("caf\xe9 latin-1 ".encode("latin-1") * 20)
    (tmp_path / "c" / "rows.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\nnot json\n')
    cfg = lambda **k: from_dict({"data": {**data(tmp_path / "c"), "val_docs": ["doc1"], **k}}).data
    with pytest.raises(ValueError, match=r"latin.txt is not UTF-8 text \(20 of its 260 bytes are not, the first at "
                                         r"byte 3\); fix or remove it, or set data.invalid_utf8: skip"):
        prepare(cfg(), log=lambda _: None)
    (tmp_path / "c" / "latin.txt").unlink()
    with pytest.raises(ValueError, match=r"rows.jsonl line 2 has no string field 'text' \(data.text_field; it has: "
                                         r"body\)"):
        prepare(cfg(), log=lambda _: None)
    (tmp_path / "c" / "latin.txt").write_bytes(b"\xff\xfe" * 10)
    lines = []
    prepare(cfg(invalid_utf8="skip"), log=lines.append)
    skipped, = [line for line in lines if "skipped" in line]
    assert "skipped 3 " in skipped and "latin.txt (20 bytes not UTF-8)" in skipped
    assert "rows.jsonl:2 (no 'text')" in skipped and "rows.jsonl:3 (not JSON)" in skipped
    with pytest.raises(ValueError, match=r"train.seq_len: 5000 does not fit the train split of data.corpus "
                                         r"\(\d+ tokens; a window needs seq_len \+ 2 = 5002\)"):
        prepare(cfg(invalid_utf8="skip"), log=lambda _: None).batches(5000, 0, packing=False)
    with pytest.raises(ValueError, match="data.shard_dtype: uint16 holds ids below 65536 but the tokenizer has 70000"):
        from_dict({"data": {"tokenizer": {"kind": "bpe", "vocab_size": 70000}, "shard_dtype": "uint16"}})
    with pytest.raises(ValueError, match=r"model.vocab_size: 512 does not match the tokenizer's 300 ids "
                                         r"\(data.tokenizer.vocab_size=300\)"):
        from_dict({"model": {"vocab_size": 512}, "data": {"tokenizer": {"kind": "bpe", "vocab_size": 300}}})
    with pytest.raises(ValueError, match="data.val_docs: \\['nope'\\] not in corpus"):
        prepare(cfg(val_docs=["nope"]), log=lambda _: None)
    (tmp_path / "c" / "t.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="t.parquet is a .parquet file, which needs the package pyarrow"):
            prepare(cfg(), log=lambda _: None)


def test_a_hashed_split_is_by_document_and_the_same_everywhere(tmp_path):
    folder = tmp_path / "j"
    folder.mkdir()
    rows = [{"text": f"document {i}: " + " ".join(WORDS[i % 7:])} for i in range(200)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = from_dict({"data": {"corpus": str(folder), "val_fraction": 0.2, "shard_mb": 0.002}}).data
    corpus = prepare(cfg, log=lambda _: None)
    counts = {s: corpus.meta["splits"][s]["docs"] for s in ("train", "val")}
    assert counts["train"] + counts["val"] == 200 and 20 < counts["val"] < 60
    assert len(corpus.meta["splits"]["train"]["shards"]) > 2  # the JSONL file was cut into pieces at line ends
    val = corpus.stream("val").tokens().tobytes().decode().split("\0")[:-1]
    train = corpus.stream("train").tokens().tobytes().decode().split("\0")[:-1]
    assert sorted(val + train) == sorted(r["text"] for r in rows)  # whole documents, each in one split
