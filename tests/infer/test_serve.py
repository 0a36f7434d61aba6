"""The HTTP endpoint (infer/serve.py), through a real HTTP client on loopback: one uvicorn server on a tiny
model for the file. Every completion is what infer.generate_text gives its prompt alone."""

import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import uvicorn

import infer
from infer import Engine, serve, stops
from tests.util import tiny_model
from zoo.tokenizer import Bytes

PROMPTS = ["ROMEO:", "JULIET: O", "To be", "What light", "Is this a dagger", "Once more unto"]
M = 12  # max_tokens of every request compared with generate_text, which compiles once per max_new_tokens
MAX_LEN = 1024
SAMPLING = infer.Sampling(temperature=0.8, top_k=40, top_p=0.9)


@contextlib.contextmanager
def serving(application):
    """`application` served by uvicorn in a thread on a free loopback port, which it yields."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(application, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join()


@pytest.fixture(scope="module")
def server():
    model = tiny_model(num_layers=1)
    ids = infer.generate(model, [Bytes.encode(p) for p in PROMPTS], max_new_tokens=M)
    want = dict(zip(PROMPTS, infer.generate_text(model, PROMPTS, max_new_tokens=M)))  # the same compiled loop
    sampled = infer.generate_text(model, PROMPTS[-1:], max_new_tokens=M, sampling=SAMPLING, seed=5)  # alone
    with serving(serve.app(model, name="tiny", slots=3, max_len=MAX_LEN, chunk=8)) as port:
        yield SimpleNamespace(port=port, model=model, want=want, ids=dict(zip(PROMPTS, ids)),
                              sampled=sampled[0])


def connect(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)


def post(server, body):
    """(status, the JSON answer) of a POST of `body` (bytes as they are, anything else as JSON)."""
    conn = connect(server)
    conn.request("POST", "/v1/completions", body if isinstance(body, bytes) else json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def get(server, path):
    conn = connect(server)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read().decode()


def stream(server, body, lines: int | None = None) -> list:
    """The events of a streamed completion (their JSON, and "[DONE]"), or its first `lines` data lines
    before the client hangs up."""
    conn = connect(server)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = []
    while lines is None or len(events) < lines:
        line = response.readline().decode()
        if not line:
            break
        if line.startswith("data: "):
            data = line[6:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def metrics(server) -> dict:
    status, text = get(server, "/metrics")
    assert status == 200
    return {name: float(value) for name, value in (line.split() for line in text.splitlines())}


def greedy(prompt, **body):
    return {"model": "tiny", "prompt": prompt, "max_tokens": M, "temperature": 0, **body}


def test_a_completion_is_what_generate_gives(server):
    status, out = post(server, greedy(PROMPTS[0], user="someone", echo=False, n=1, logprobs=None))
    assert status == 200, out
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"].startswith("cmpl-")
    want, P = server.want[PROMPTS[0]], len(PROMPTS[0])
    assert out["choices"] == [{"text": want, "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == {"prompt_tokens": P, "completion_tokens": M, "total_tokens": P + M}
    status, out = post(server, greedy(PROMPTS[:2]))  # a list of prompts: a choice each
    assert [c["text"] for c in out["choices"]] == [server.want[p] for p in PROMPTS[:2]]
    status, out = post(server, greedy(list(PROMPTS[2].encode())))  # token ids
    assert out["choices"][0]["text"] == server.want[PROMPTS[2]]
    assert json.loads(get(server, "/v1/models")[1])["data"][0]["id"] == "tiny"
    assert get(server, "/health") == (200, '{"status":"ok"}')


def test_a_sampled_completion_is_what_generate_gives_with_its_seed(server):
    body = greedy(PROMPTS[-1], temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, top_p=SAMPLING.top_p, seed=5)
    assert post(server, body)[1]["choices"][0]["text"] == server.sampled


def test_a_stream_sends_the_same_text(server):
    events = stream(server, greedy(PROMPTS[1], stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == M
    chunks = events[:-2]
    assert "".join(e["choices"][0]["text"] for e in chunks) == server.want[PROMPTS[1]]
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(chunks) > 2  # sent as the tokens came


def test_concurrent_requests_each_get_their_own_answer(server):
    """More requests than slots, streamed and not, at once."""
    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            return prompt, "".join(e["choices"][0]["text"] for e in stream(server, greedy(prompt))[:-1])
        return prompt, post(server, greedy(prompt))[1]["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        for prompt, text in pool.map(one, range(8)):
            assert text == server.want[prompt], prompt


def test_stop_strings_cut_the_text_and_are_never_streamed(server):
    text = server.want[PROMPTS[3]]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = text[:text.find(stop)]
    assert cut != text
    status, out = post(server, greedy(PROMPTS[3], stop=[stop, "never written"]))
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == stops.build(stop, Bytes.token_bytes()).end(server.ids[PROMPTS[3]])
    chunks = [e["choices"][0]["text"] for e in stream(server, greedy(PROMPTS[3], stop=stop))[:-1]]
    assert "".join(chunks) == cut


def test_text_never_sends_half_a_character_nor_the_start_of_a_stop_string():
    """Bytes one token at a time: é is two; "é!" and "ab" are stop strings."""
    text = serve.Text(Bytes.token_bytes(), stops.build(["é!", "ab"], Bytes.token_bytes()))
    sent = [text.add([b], final=False) for b in "xé?aé!".encode()]
    assert sent == ["x", "", "", "é?", "", "", "a", ""]
    text = serve.Text(Bytes.token_bytes(), None)
    assert [text.add([0xC3], final=False), text.add([0xA9, 0xC3], final=True)] == ["", "é\ufffd"]


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "not valid JSON"),
    ([1, 2], None, "JSON object"),
    ({"prompt": 5}, "prompt", "expected a string"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens", "expected an integer"),
    ({"prompt": "a", "stream": 1}, "stream", "true or false"),
    ({"prompt": "a", "stop": ["", "b"]}, "stop", "non-empty string"),
    ({"prompt": "a", "seed": -1}, None, "[0, 2**32)"),
    ({"prompt": "a", "n": 2}, "n", "not supported"),
    ({"prompt": "a", "logprobs": 1}, "logprobs", "not supported"),
    ({"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"prompt": "a", "temperature": -1}, None, "temperature >= 0"),
    ({"prompt": ["a", ""]}, None, "prompt 1: "),
])
def test_a_malformed_request_gets_a_clear_400(server, body, param, words):
    status, out = post(server, body)
    assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    assert words in out["error"]["message"] and out["error"]["param"] == param, out


def test_the_server_keeps_serving_after_errors(server):
    assert get(server, "/nowhere")[0] == 404 and "error" in json.loads(get(server, "/nowhere")[1])
    assert post(server, greedy(PROMPTS[0]))[1]["choices"][0]["text"] == server.want[PROMPTS[0]]
    assert metrics(server)["zoo_engine_running"] == 0 and metrics(server)["zoo_engine_queued"] == 0


def test_a_prompt_longer_than_the_model_accepts_is_refused(server):
    status, out = post(server, greedy("x" * MAX_LEN))
    assert status == 400
    assert f"{MAX_LEN} tokens" in out["error"]["message"] and f"max_len={MAX_LEN}" in out["error"]["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    """It hangs up after the first event: its request is cancelled long before its max_tokens."""
    before = metrics(server)["zoo_engine_generated_tokens"]
    max_tokens = MAX_LEN - len(PROMPTS[0])
    assert len(stream(server, greedy(PROMPTS[0], max_tokens=max_tokens), lines=1)) == 1
    for _ in range(500):
        if metrics(server)["zoo_engine_running"] == 0:
            break
        time.sleep(0.01)
    now = metrics(server)
    assert now["zoo_engine_running"] == 0 and now["zoo_engine_queued"] == 0
    assert now["zoo_engine_generated_tokens"] - before < max_tokens / 2


def test_a_failed_engine_step_answers_500_and_health_503(server, monkeypatch):
    """A second server whose engine's steps raise: the request waiting and every later one get the error."""
    def step(engine):
        raise RuntimeError("a bug in a step")

    monkeypatch.setattr(Engine, "step", step)
    with serving(serve.app(server.model, slots=1, max_len=32, chunk=8)) as port:
        broken = SimpleNamespace(port=port)
        for _ in range(2):
            status, out = post(broken, {"prompt": "a"})
            assert status == 500 and out["error"]["message"] == "RuntimeError: a bug in a step"
        status, out = get(broken, "/health")
        assert status == 503 and "a bug in a step" in out
