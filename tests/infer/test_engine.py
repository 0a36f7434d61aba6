"""The serving engine (infer/engine.py): every request gets exactly what infer.generate gives its prompt,
whatever the arrivals, the slots it lands in, the chunk size and the prefix cache; for every registered
mixer kind and a hybrid."""

import numpy as np
import pytest

import infer
from infer import Engine, Request, Sampling, stops
from infer import engine as engine_lib
from tests.layers.test_conformance import TINY
from tests.util import tiny_model
from zoo.registry import MIXERS

RNG = np.random.default_rng(0)
SHARED = RNG.integers(0, 256, 9).tolist()
# Three prompts for two slots, ragged against chunk 4: the second is one token; the third takes a freed slot
# and starts with the first's two blocks (a prefix-cache hit).
PROMPTS = [SHARED, [3], SHARED[:8] + [5, 6, 7]]
HYBRID = [{"kind": "attention", "num_heads": 4, "num_kv_heads": 2}, {"kind": "mamba", "state_size": 4},
          {"kind": "gla", "num_heads": 2, "conv_size": 4}]


def kind_model(kind: str):
    if kind == "hybrid":
        return tiny_model(layer_pattern=HYBRID, num_layers=3)
    D, options = TINY.get(kind, (32, {}))
    return tiny_model({"kind": kind, **options}, d_model=D, num_layers=2 if kind == "rwkv7" else 1)


@pytest.mark.parametrize("kind", [*MIXERS, "hybrid"])
def test_every_kind_serves_what_generate_gives(kind):
    model = kind_model(kind)
    want = infer.generate(model, PROMPTS, max_new_tokens=5)  # each row what its prompt gets alone (test_kinds)
    requests = [Request(p, 5) for p in PROMPTS]
    for cache in (1.0, 0.0):
        engine = Engine(model, slots=2, max_len=20, chunk=4, prefix_cache_mb=cache)
        assert engine.run(requests) == want, f"{kind}, prefix cache {cache} MB"
        assert engine.stats()["prefix_cache_reused_tokens"] == (8 if cache else 0)


@pytest.fixture(scope="module")
def hybrid():
    return kind_model("hybrid")


def alone(model, request: Request) -> list[int]:
    return infer.generate(model, [request.prompt], max_new_tokens=request.max_tokens, sampling=request.sampling,
                          seed=request.seed, stop_token=request.stop_token, stop_strings=request.stop)[0]


def test_arrivals_chunks_sampling_and_cache_hits_change_nothing(hybrid):
    """Greedy and sampled requests (each with its seed), arriving in two orders, into 3 slots with chunks of
    3 and 8, each with and without a prefix cache, a prompt's tail rolled back or fed through the decode lanes:
    every request's tokens are its own `generate` call's."""
    prompts = [SHARED + [1, 2], SHARED[:6], [9] * 17, SHARED + [4] * 8, [200, 100], SHARED[:7] + [0]]
    samplings = [Sampling(), Sampling(0.9, top_k=20), Sampling(1.2, top_p=0.8), Sampling(0.7, 5, 0.9)]
    requests = [Request(p, 6, samplings[i % 4], seed=i) for i, p in enumerate(prompts)]
    want = [alone(hybrid, r) for r in requests]
    traces = engine_lib.TRACES["step"]
    orders = (list(range(6)), [5, 2, 0, 4, 1, 3])
    for chunk, order, cache, tail in ((3, orders[0], 0.0, "rollback"), (3, orders[1], 1.0, "rollback"),
                                      (8, orders[1], 0.0, "rollback"), (8, orders[0], 1.0, "rollback"),
                                      (3, orders[1], 1.0, "decode"), (8, orders[0], 0.0, "decode")):
        engine = Engine(hybrid, slots=3, max_len=40, chunk=chunk, prefill_rows=2, prefix_cache_mb=cache, tail=tail)
        got = engine.run([requests[i] for i in order])
        assert got == [want[i] for i in order], (chunk, order, cache, tail)
        assert (engine.stats()["prefix_cache_reused_tokens"] > 0) == (cache > 0)
    assert engine_lib.TRACES["step"] - traces == 4  # one compiled step per chunk size and tail


def test_a_reused_slot_starts_fresh(hybrid, monkeypatch):
    """One slot serves two requests in turn: the second gets what it gets alone. The check can fail: with the
    reset skipped, the KV row, the Mamba state and the convolution windows of the first leak into it."""
    first, second = Request(SHARED, 4), Request([7, 7], 4)
    want = alone(hybrid, second)
    assert Engine(hybrid, slots=1, max_len=16, chunk=4).run([first, second])[1] == want
    monkeypatch.setattr(engine_lib, "_reset", lambda graphdef, params, state, row, size: state)
    assert Engine(hybrid, slots=1, max_len=16, chunk=4).run([first, second])[1] != want


def test_a_burst_larger_than_the_slots_finishes_every_request_once(hybrid):
    engine = Engine(hybrid, slots=2, max_len=24, chunk=4, prefill_rows=2)
    rids = [engine.submit(Request([i + 1] * (1 + i % 5), 1 + i % 4)) for i in range(11)]
    tokens, finished = {rid: [] for rid in rids}, []
    while not engine.idle:
        assert engine.stats()["running"] <= 2
        for e in engine.step():
            tokens[e.rid] += e.tokens
            if e.finish:
                finished.append(e.rid)
    assert sorted(finished) == rids
    assert [len(tokens[rid]) for rid in rids] == [1 + i % 4 for i in range(11)]


def test_stops_and_cancellation(hybrid):
    """A stop token ends a request without being returned, a stop string with its last token, as generate
    does; a cancelled request frees its slot at once and the others go on."""
    free = alone(hybrid, Request(SHARED, 8))
    stop = stops.build([f"<{free[2]}><{free[3]}>"], [f"<{i}>".encode() for i in range(256)])  # a 2-token string
    requests = [Request(SHARED, 8, stop_token=free[3]), Request(SHARED, 8, stop=stop)]
    got = Engine(hybrid, slots=2, max_len=20, chunk=4).run(requests)
    assert got == [alone(hybrid, r) for r in requests] == [free[:3], free[:4]]

    engine = Engine(hybrid, slots=1, max_len=20, chunk=4)
    a, b = engine.submit(Request(SHARED, 8)), engine.submit(Request([5], 3))
    events = engine.step() + engine.step()
    engine.cancel(a)
    assert engine.stats()["running"] == 0
    while not engine.idle:
        events += engine.step()
    assert [e.finish for e in events if e.finish] == ["cancelled", "length"]
    assert sum((e.tokens for e in events if e.rid == b), []) == alone(hybrid, Request([5], 3))


def test_the_prefix_cache_stays_under_its_budget(hybrid):
    engine = Engine(hybrid, slots=2, max_len=40, chunk=4, prefix_cache_mb=1.0)
    engine.run([Request([1] * 5, 1)])  # one block cached: its bytes
    block = engine.cache.bytes
    engine.cache.budget = 4 * block  # room for four blocks
    prompts = [RNG.integers(0, 256, 13).tolist() for _ in range(4)]
    want = [alone(hybrid, Request(p, 2)) for p in prompts]
    assert engine.run([Request(p, 2) for p in prompts]) == want
    assert engine.cache.bytes <= 4 * block and len(engine.cache.blocks) == 4
    reused = engine.stats()["prefix_cache_reused_tokens"]
    assert engine.run([Request(prompts[-1], 2)]) == want[-1:]
    assert engine.stats()["prefix_cache_reused_tokens"] - reused == 12  # the latest prompt's three blocks were kept


@pytest.mark.parametrize("request_, message", [
    (Request([], 4), "every prompt needs at least one token"),
    (Request([1] * 15, 6), "more than the engine's max_len=20"),
    (Request([300], 4), r"token ids must be in \[0, 256\)"),
    (Request([1], 4, Sampling(0.5, top_k=0)), "1 <= top_k <= 256"),
    (Request([1], 4, stop_token=256), "stop_token=256"),
])
def test_bad_requests_are_refused_before_they_queue(hybrid, request_, message):
    engine = Engine(hybrid, slots=1, max_len=20, chunk=4)
    with pytest.raises(ValueError, match=message):
        engine.submit(request_)
    assert engine.idle


def test_a_quantized_model_serves_with_its_int8_cache(hybrid):
    """infer.quantize's model (int8 weights and KV cache: codes and scales per slot) in the engine, its prefix
    blocks included, gives what generate gives it."""
    model = infer.quantize(hybrid, weights="int8", kv_cache="int8")
    requests = [Request(p, 4) for p in PROMPTS]
    engine = Engine(model, slots=2, max_len=20, chunk=4, prefix_cache_mb=1.0)
    assert engine.run(requests) == infer.generate(model, PROMPTS, max_new_tokens=4)
    assert engine.stats()["prefix_cache_reused_tokens"] == 8
