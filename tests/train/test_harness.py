"""The lm-eval backend (train/harness.py) against the model's own forward pass, infer.generate, lm-eval's
Hugging Face backend (a committed fixture), the local tasks and a mesh of two simulated devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval.api.instance import Instance

from infer import generate, generate_text
from tests.util import tiny_model
from train.harness import TASKS, ZooLM
from zoo import tokenizer as tokenizer_lib

ROOT = Path(__file__).parents[2]
L = 128  # the tiny model's max_seq_len


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_seq_len=L)


@pytest.fixture(scope="module")
def lm(model):
    return ZooLM(model=model, batch_size=4)


def request(kind, args, i=0, task="t"):
    return Instance(kind, {}, args, i, (task, i, 1))


def direct(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-probability and greediness from one forward pass over this request alone."""
    ids = np.asarray(context + continuation, np.int32)
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(ids[None, :-1])).astype(jnp.float32))[0], np.float64)
    rows = np.arange(len(context) - 1, len(ids) - 1)
    targets = ids[len(context):]
    return float(logp[rows, targets].sum()), bool((logp[rows].argmax(-1) == targets).all())


PAIRS = [("ROMEO:\n", " But soft"), ("To be, or not to be", ", that is the question"), ("a" * 90, "b" * 30),
         ("", "Hamlet"), ("What light through yonder window breaks?", " It is"), ("x", "y")]


def test_loglikelihood_equals_forward_alone_whatever_packing(model, lm):
    got = lm.loglikelihood([request("loglikelihood", p, i) for i, p in enumerate(PAIRS)])
    one_row_each = ZooLM(model=model, batch_size=1).loglikelihood(
        [request("loglikelihood", p, i) for i, p in enumerate(PAIRS)])
    for (ctx, cont), (lp, greedy), (lp1, greedy1) in zip(PAIRS, got, one_row_each):
        kept = ctx.rstrip()  # lm-eval moves a context's trailing whitespace into the continuation
        want, want_greedy = direct(model, tokenizer_lib.encode(kept) or [0],
                                   tokenizer_lib.encode(ctx[len(kept):] + cont))
        assert abs(lp - want) < 1e-4 * max(1, abs(want)) and greedy == want_greedy, (ctx, lp, want)
        assert abs(lp1 - want) < 1e-4 * max(1, abs(want)) and greedy1 == want_greedy


def test_is_greedy(model, lm):
    context = tokenizer_lib.encode("KING HENRY:\n")
    (greedy,) = generate(model, [context], max_new_tokens=5)
    other = greedy[:3] + [(greedy[3] + 1) % 256] + greedy[4:]
    (_, yes), (_, no) = lm.score([(context, greedy), (context, other)])
    assert yes and not no


def test_rolling_equals_sum_over_disjoint_windows(model, lm):
    text = (TASKS / "shakespeare_ppl.jsonl").read_text().splitlines()
    text = json.loads(text[0])["text"][:3 * L + 17]
    ids = tokenizer_lib.encode(text)
    want = direct(model, [0], ids[:L])[0]  # the first window after the prefix token (bytes: 0, end of document)
    for start in range(L, len(ids), L):  # then L predicted tokens each, after the one token before them
        want += direct(model, ids[start - 1:start], ids[start:start + L])[0]
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])
    assert abs(got - want) < 1e-4 * abs(want)


def test_generation_equals_infer_generate(model, lm):
    prompts = ["ROMEO:\n", "Thou art", "O"]
    kwargs = {"until": ["\n", "ee"], "max_gen_toks": 12}
    got = lm.generate_until([request("generate_until", (p, kwargs), i) for i, p in enumerate(prompts)])
    assert got == generate_text(model, prompts, max_new_tokens=12, stop=["\n", "ee"])


def test_local_tasks_run_in_simple_evaluate(lm):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=lm, tasks=["zoo_shakespeare_mc", "zoo_shakespeare_ppl"], limit=4,
                                  task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))["results"]
    assert 0 <= out["zoo_shakespeare_mc"]["acc,none"] <= 1
    assert out["zoo_shakespeare_ppl"]["bits_per_byte,none"] > 0


def test_hf_fixture_equals_lm_eval_hf_backend():
    """tests/fixtures/hf/make_lm_eval_fixture.py's requests, scored by lm-eval's HF backend with transformers."""
    expected = json.loads((ROOT / "tests/fixtures/hf/lm_eval_llama.json").read_text())
    mc = [json.loads(line) for line in (TASKS / "shakespeare_mc.jsonl").read_text().splitlines()[:6]]
    texts = [json.loads(line)["text"] for line in (TASKS / "shakespeare_ppl.jsonl").read_text().splitlines()[:2]]
    pairs = [(d["context"], c) for d in mc for c in d["choices"]]
    lm = ZooLM(path=str(ROOT / "tests/fixtures/hf/llama"), batch_size=4)
    assert (lm.max_length, lm.prefix_token_id) == (expected["max_length"], expected["prefix_token_id"])
    got = lm.loglikelihood([request("loglikelihood", p, i) for i, p in enumerate(pairs)])
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected["loglikelihood"]], rtol=1e-4)
    assert [g[1] for g in got] == [e[1] for e in expected["loglikelihood"]]
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", (t,), i) for i, t in enumerate(texts)])
    np.testing.assert_allclose(rolling, expected["rolling"], rtol=1e-4)


def test_bad_input_is_named(model, tmp_path):
    with pytest.raises(ValueError, match=r"unknown model_args \['pretrained'\]"):
        ZooLM.create_from_arg_string("path=runs/x,pretrained=gpt2")
    with pytest.raises(ValueError, match="not a run folder with checkpoints"):
        ZooLM(path=str(tmp_path))
    long = request("loglikelihood", ("a" * (L + 10), "b"), task="long_task")
    hyena = ZooLM(model=tiny_model({"kind": "hyena"}, max_seq_len=L, num_layers=1))
    with pytest.raises(ValueError, match="task 'long_task'.*max_seq_len=128"):
        hyena.loglikelihood([long])
    with pytest.raises(ValueError, match="task 'long_task'.*max_seq_len=128"):
        hyena.generate_until([request("generate_until", ("a" * (L - 4), {"max_gen_toks": 8}), task="long_task")])
    (lp, _), = ZooLM(model=model).loglikelihood([long])  # attention, long_context: window takes any length
    assert lp == pytest.approx(direct(model, tokenizer_lib.encode("a" * (L + 10)), [ord("b")])[0], rel=1e-4)


MESH_CHECK = """
import os
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
from flax import nnx
from lm_eval.api.instance import Instance
from tests.util import tiny_config
from train.harness import ZooLM
from zoo import LanguageModel
from zoo.config import MeshConfig
from zoo.sharding import init_on_mesh, make_mesh

cfg = tiny_config(max_seq_len=128)
build = lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))
reqs = [Instance("loglikelihood", {}, ("ab" * k, "cd" * k), k, ("t", k, 1)) for k in range(1, 6)]
want = ZooLM(model=build(), batch_size=2).loglikelihood(reqs, disable_tqdm=True)
for mesh in (MeshConfig(data=2), MeshConfig(data=1, fsdp=2)):
    mesh = make_mesh(mesh)
    graphdef, params, rest, _ = init_on_mesh(build, mesh)
    lm = ZooLM(model=nnx.merge(graphdef, params, rest), batch_size=2, mesh=mesh)
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    assert all(abs(g[0] - w[0]) < 1e-4 * abs(w[0]) and g[1] == w[1] for g, w in zip(got, want)), (got, want)
try:
    ZooLM(model=build(), batch_size=3, mesh=mesh)
    raise AssertionError("batch_size=3 on 2 devices was accepted")
except ValueError as e:
    assert "multiple of 2" in str(e), e
print("ok")
"""


def test_mesh_places_batches_and_gives_one_devices_scores():
    """On 2 simulated CPU devices (a subprocess, so this one keeps one device), over data and over fsdp."""
    out = subprocess.run([sys.executable, "-c", MESH_CHECK], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
