"""Shared test helpers."""

import contextlib
import functools
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HF_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"  # written by transformers: make_fixtures.py
# The C++ CPU kernels (kernels/native.py) are built with the machine's compiler: without one the ops run their XLA
# forms, and the tests of the kernels themselves cannot run, like the GPU and TPU ones elsewhere.
NEEDS_CXX = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                               reason="no C++ compiler ($CXX, default c++): the CPU kernels are not built")
HF_PROMPTS = ["From fairest creatures", "thy sweet self"]  # the prompts of the fixtures' greedy rows (make_fixtures.py)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: the error measure every op test uses (float32 target: < 1e-4); complex arrays by
    their moduli."""
    dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
    a, b = np.asarray(a, dtype), np.asarray(b, dtype)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def assert_close(a, b, tol=1e-4, what=""):
    err = rel_err(a, b)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def assert_tree_close(a, b, tol=1e-4, what=""):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        assert_close(x, y, tol, f"{what}{jax.tree_util.keystr(path)}")


def randn(key, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key) if isinstance(key, int) else key, shape)).astype(dtype)


def tiny_config(mixer=None, layer_pattern=None, **model):
    """A small ModelConfig for tests; `mixer` / `layer_pattern` are config dicts."""
    from zoo.config import from_dict

    m = {"d_model": 32, "num_layers": 2, "max_seq_len": 256, **model}
    if layer_pattern is not None:
        m["layer_pattern"] = layer_pattern
    else:
        m["mixer"] = mixer or {"kind": "attention", "num_heads": 4}
    return from_dict({"model": m}).model


def tiny_model(mixer=None, seed=0, **model):
    from flax import nnx

    from zoo import LanguageModel

    return LanguageModel(tiny_config(mixer, **model), rngs=nnx.Rngs(seed))


def edited_config(cfg, edit):
    """The ModelConfig `cfg` rebuilt after `edit(section)` changes its dict form (zoo.schema.to_dict) in place."""
    from zoo.config import build_model
    from zoo.schema import to_dict

    section = to_dict(cfg)
    edit(section)
    return build_model(section, "model")


def assert_save_refuses(cfg, message, path):
    """zoo.hf.save refuses a model of `cfg` with a ValueError matching `message` before it reads a weight: the model
    is abstract (nnx.eval_shape), its parameters and state shapes alone."""
    import pytest
    from flax import nnx

    import zoo.hf
    from zoo.model import LanguageModel

    model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=message):
        zoo.hf.save(model, path)


def hf_greedy(case, tok) -> tuple[list, list]:
    """The fixture's prompts as token ids, and transformers' greedy continuations of 10 tokens, cut after an eos as
    infer.generate stops (stop_token=tok.eos_id)."""
    expected = np.load(HF_FIXTURES / case / "expected.npz")
    rows = [expected[f"greedy_{i}"].tolist() for i in range(len(HF_PROMPTS))]
    return [tok.encode(p) for p in HF_PROMPTS], [r[:r.index(tok.eos_id)] if tok.eos_id in r else r for r in rows]


def hf_loaded(case: str):
    """A module-scoped pytest fixture `loaded`: zoo.hf.load of tests/fixtures/hf/<case>, (model, tokenizer), read
    once for the test file that assigns it (`loaded = hf_loaded("jamba")`)."""
    import pytest

    import zoo.hf

    return pytest.fixture(scope="module", name="loaded")(lambda: zoo.hf.load(HF_FIXTURES / case))


def hf_fixture(tmp_path, case, **changes):
    """A copy of the Hugging Face fixture folder tests/fixtures/hf/<case> in tmp_path, with config.json's fields
    set to `changes` (a None removes the field)."""
    folder = tmp_path / case
    shutil.copytree(HF_FIXTURES / case, folder)
    if changes:
        f = folder / "config.json"
        edited = {**json.loads(f.read_text()), **changes}
        f.write_text(json.dumps({k: v for k, v in edited.items() if v is not None}))
    return folder


@functools.cache
def _jitted(method: str):
    """One jitted `model.<method>(tokens, ..., segment_ids=s)` for the whole suite: jit's cache is keyed by the
    model's structure and the shapes, so a test that runs a model another test ran reuses its compile."""
    from flax import nnx

    return nnx.jit(lambda m, t, *rest, s: getattr(m, method)(t, *rest, segment_ids=s))


def forward(model, tokens, segment_ids=None):
    """model(tokens) under one jit: a few compiles instead of one per primitive and shape."""
    return _jitted("__call__")(model, tokens, s=segment_ids)


def decode_in_pieces(model, tokens, cuts, segment_ids=None, max_len=None):
    """Logits from model.decode over consecutive slices tokens[:, a:b] split at `cuts`."""
    step = lambda m, t, st, s: _jitted("decode")(m, t, st, s=s)
    B, T = tokens.shape
    state = model.init_state(B, max_len or T)
    edges = [0, *cuts, T]
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = None if segment_ids is None else segment_ids[:, a:b]
        logits, state = step(model, tokens[:, a:b], state, seg)
        out.append(logits)
    return jnp.concatenate(out, axis=1), state


def packed_equals_alone(model, doc_lengths, key=0, tol=1e-4):
    """A packed row of documents gives each document's logits alone. The documents alone run as one
    right-padded batch: by causality the padding cannot change their logits."""
    tokens = jax.random.randint(jax.random.key(key), (1, sum(doc_lengths)), 1, 256)
    seg = jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in enumerate(doc_lengths)])[None]
    packed = forward(model, tokens, seg)
    starts = [sum(doc_lengths[:i]) for i in range(len(doc_lengths))]
    L = max(doc_lengths)
    docs = jnp.stack([jnp.pad(tokens[0, s:s + n], (0, L - n), constant_values=1) for s, n in zip(starts, doc_lengths)])
    alone = forward(model, docs)
    alone = jnp.concatenate([alone[i, :n] for i, n in enumerate(doc_lengths)])[None]
    assert_close(packed, alone, tol, "packed vs alone")


@contextlib.contextmanager
def unchecked():
    """Without the suite's run-time annotation checks (tests/conftest.py), as users run: for tests
    of the library's own error messages on inputs the annotations already reject."""
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def record_calls(module, name: str) -> list:
    """The keyword arguments of every call of `module.name` from now on (it is wrapped in place), a dict a call,
    in a list the caller may clear. A check that a path ran, e.g. a context-parallel form, where its result
    alone would equal the path it replaces."""
    calls, inner = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return inner(*args, **kwargs)

    setattr(module, name, recorded)
    return calls


def count_calls(module, name: str):
    """Count the calls of `module.name` from now on (it is wrapped in place, `record_calls`): () -> how many."""
    calls = record_calls(module, name)
    return lambda: len(calls)
