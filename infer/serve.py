"""python -m infer.serve RUN_DIR_OR_CONFIG_OR_HF_FOLDER --port 8000

An OpenAI-compatible HTTP endpoint on the serving engine (infer/engine.py), so clients written for OpenAI's
completions API (its Python package given this server's base URL, curl) talk to any zoo model. The source is
read as `python -m infer` reads it: a run folder, a Hugging Face folder (with its tokenizer.json; --dtype
bfloat16) or a YAML config (random weights; overrides after it). --slots, --max-len (prompt + max_tokens),
--chunk, --prefill-rows, --prefix-cache-mb and --tail set the engine.

    POST /v1/completions   OpenAI's completion: {"prompt": "ROMEO:", "max_tokens": 64, "stop": ["\\n\\n"], ...};
                           "stream": true answers in server-sent events, `data: {chunk}` ... `data: [DONE]`
    GET  /v1/models        the one model served (--name; default the source's folder or file name)
    GET  /health           200 while the engine runs, 503 once a step has failed
    GET  /metrics          the engine's numbers (Engine.stats) in Prometheus' text format

It listens on 127.0.0.1, this machine only; --host 0.0.0.0 listens on every interface. It checks no key:
to serve others, put a reverse proxy in front that does (docs/serving.md).

A completion takes prompt (a string, a list of strings, one choice each, or token ids), max_tokens (default
16), temperature (default 1), top_p, seed (default a random one), stop (strings of any length), stream and
stream_options.include_usage, as OpenAI's do, and top_k as vLLM's does. Fields that would change the output in
ways not implemented here (n or best_of > 1, echo, logprobs, suffix, penalties, logit_bias) are refused by
name, as is any unknown field: a 400 with OpenAI's error body.

The engine is not thread-safe and its steps block, so it runs in one thread (`Worker`) that applies submits
and cancels between steps and sleeps when idle; the event loop never waits for it, and hears of each request's
tokens through an asyncio queue. A completion's text is its tokens' bytes (`tokenizer.token_bytes()`: the
text they add after the prompt, the bytes stop strings are matched on; a SentencePiece vocabulary's leading
space stays) decoded as UTF-8 as they arrive, so a stream never sends half a character; it is cut before the
earliest stop string, and a stream holds back any end of the text that could begin one, so no stop text is
ever sent. A client that disconnects, streaming or not, cancels its requests and frees their slots.
"""

import argparse
import asyncio
import codecs
import json
import logging
import queue
import secrets
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as e:
    raise ImportError("infer.serve needs the serve extra: pip install -e '.[serve]'") from e

from infer import stops
from infer.engine import Engine, Request
from infer.generate import Sampling
from zoo import tokenizer as tokenizer_lib

# Fields that would change the output in a way this server does not implement: refused unless they hold the
# value that leaves the output alone (OpenAI's default, null, or an empty string or object).
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": None}
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "user", *UNSUPPORTED}  # model and user are read and ignored


class BadRequest(ValueError):
    """A request refused with a 400 that names the field at fault (`param`, OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse(body, tok, V: int) -> tuple[list[Request], bool, bool]:
    """A /v1/completions body as (the engine requests, one per prompt; whether to stream; whether the stream
    ends with a usage chunk), for tokenizer `tok` and a model of V ids. The engine checks the values."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {json.dumps(body)[:80]}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; a completion takes {', '.join(sorted(FIELDS))}", unknown[0])
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != off and value not in ("", {}):
            raise BadRequest(f"{name}={json.dumps(value)} is not supported by this server (it would change the "
                             "output); leave it out", name)
    top_k = _field(body, "top_k", int, None)
    top_p = _field(body, "top_p", float, None)
    sampling = Sampling(_field(body, "temperature", float, 1.0), None if top_k in (0, -1) else top_k,  # vLLM's "off"
                        None if top_p == 1 else top_p)
    seed = _field(body, "seed", int, None)
    stop = body.get("stop")
    try:
        stop = None if stop in (None, "", []) else stops.for_tokenizer(tok, stops.checked(stop), V)  # as OpenAI
    except ValueError as e:
        raise BadRequest(str(e), "stop") from None
    stream, options = _field(body, "stream", bool, False), body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or (options and not stream):
        raise BadRequest(f"stream_options={json.dumps(options)}: expected {{\"include_usage\": true or false}}, "
                         "with stream true", "stream_options")
    request = dict(max_tokens=_field(body, "max_tokens", int, 16), sampling=sampling, stop_token=tok.eos_id,
                   seed=secrets.randbelow(2**32) if seed is None else seed, stop=stop)
    return ([Request(ids, **request) for ids in _prompts(body.get("prompt"), tok)], stream,
            bool(options.get("include_usage")))


def _field(body: dict, name: str, kind: type, default):
    """body[name] if it is a JSON value of `kind` (int, float: any number, bool); `default` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int if kind is int else (int, float) if kind is float else bool) or (
            kind is not bool and isinstance(value, bool)):
        expected = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise BadRequest(f"{name}={json.dumps(value)}: expected {expected}", name)
    return value


def _prompts(prompt, tok) -> list[list[int]]:
    """The token ids of each prompt: OpenAI's prompt is a string, a list of strings, token ids or lists of them."""
    ids = lambda p: isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if ids(prompt) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt and all(map(ids, prompt)):
        return prompt
    raise BadRequest(f"prompt={json.dumps(prompt)[:80]}: expected a string, a list of strings, a list of token ids "
                     "or a list of such lists", "prompt")


class Text:
    """One choice's text as its tokens arrive (`add`): their bytes decoded as UTF-8 (never half a character) and
    cut before the earliest stop string; what may be sent so far holds back any end that could begin a stop
    string until the request finishes."""

    def __init__(self, token_bytes: list[bytes], stop: stops.StopStrings | None):
        self.token_bytes, self.stop = token_bytes, stop
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.text, self.sent, self.tokens = "", 0, 0

    def add(self, tokens: list[int], final: bool) -> str:
        """The text that may be sent after `tokens` (`final`: the request's last ones) that was not sent before."""
        self.tokens += len(tokens)
        self.text += self.utf8.decode(b"".join(self.token_bytes[t] for t in tokens), final=final)
        end = len(self.text)
        if self.stop is not None:
            end = len(self.stop.cut(self.text))
            end -= 0 if final or end < len(self.text) else self.stop.pending(self.text)
        new, self.sent = self.text[self.sent:end], max(self.sent, end)
        return new


class Job:
    """One HTTP request's engine requests and the queue the engine's thread answers on: None once all are
    queued, a BadRequest if one was refused (then none runs), (choice index, Event) for each event, or the
    exception that stopped the engine."""

    def __init__(self, requests: list[Request]):
        self.requests, self.rids = requests, []
        self.loop, self.news = asyncio.get_running_loop(), asyncio.Queue()

    def put(self, item):
        """From the engine's thread."""
        self.loop.call_soon_threadsafe(self.news.put_nowait, item)

    async def get(self):
        item = await self.news.get()
        if isinstance(item, Exception):
            raise item
        return item


class Worker:
    """The engine in a thread of its own: between steps it applies the submits and cancels the event loop sends
    (`commands`: sending never waits), it steps while there is work and sleeps on `wake` when idle. A step
    that raises stops it: every job waiting or sent later gets the error, and /health says so."""

    def __init__(self, engine: Engine):
        self.engine, self.owner = engine, {}  # request id -> (job, choice index), while it runs
        self.commands, self.wake = queue.SimpleQueue(), threading.Event()
        self.stats, self.error = engine.stats(), None  # stats: read by /metrics, renewed after every step
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)

    def submit(self, job: Job):
        self._send(self._submit, job)

    def cancel(self, job: Job):
        """Cancel the job's requests that still run (none, once all have finished)."""
        self._send(self._cancel, job)

    def close(self):
        self._send(None, None)
        self.thread.join()

    def _send(self, command, job):
        self.commands.put((command, job))
        self.wake.set()
        if self.error is not None and job is not None:  # the thread has stopped, perhaps before it saw this command
            job.put(self.error)

    def run(self):
        try:
            while True:
                self.wake.clear()  # before reading the commands: one sent from here on wakes the wait below
                while not self.commands.empty():
                    command, job = self.commands.get()
                    if command is None:
                        return
                    command(job)
                if self.engine.idle:
                    self.wake.wait()
                    continue
                for event in self.engine.step():
                    job, i = (self.owner.pop if event.finish else self.owner.get)(event.rid, (None, None))
                    if job is not None:  # None: a request cancelled by its job, which no longer listens
                        job.put((i, event))
                self.stats = self.engine.stats()
        except Exception as e:
            self.error = e
            for job, _ in self.owner.values():
                job.put(e)
            while not self.commands.empty():
                if (job := self.commands.get()[1]) is not None:
                    job.put(e)
            logging.getLogger(__name__).exception("the engine stopped")

    def _submit(self, job: Job):
        try:
            for request in job.requests:
                job.rids.append(self.engine.submit(request))
        except ValueError as e:
            for rid in job.rids:  # all or none: these are only queued, and their events find no owner
                self.engine.cancel(rid)
            job.put(BadRequest(f"prompt {len(job.rids)}: {e}" if len(job.requests) > 1 else str(e)))
            return
        self.owner.update({rid: (job, i) for i, rid in enumerate(job.rids)})
        job.put(None)

    def _cancel(self, job: Job):
        for rid in job.rids:
            if self.owner.pop(rid, None) is not None:
                self.engine.cancel(rid)


class EventStream(StreamingResponse):
    """Server-sent events that call `close` however the response ends: finished, failed, or the client gone
    (Starlette then cancels the body's generator wherever it is, perhaps before it ever ran)."""

    def __init__(self, events, close):
        # no-cache and X-Accel-Buffering: a proxy (nginx) passes each event on at once instead of buffering them
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


def app(model, tokenizer=None, *, name: str = "zoo", **engine_kwargs) -> Starlette:
    """The endpoint's ASGI application (run it with uvicorn) serving `model` through `tokenizer` (zoo/tokenizer.py;
    default bytes) as model `name`; `engine_kwargs` go to `Engine` (slots, max_len, chunk, ...)."""
    tok = tokenizer or tokenizer_lib.Bytes
    V = model.cfg.vocab_size
    if tok.vocab_size > V:
        raise ValueError(f"infer.serve: the tokenizer has {tok.vocab_size} ids but the model {V} (model.vocab_size)")
    engine = Engine(model, **engine_kwargs)
    worker, vocab, created = Worker(engine), stops.token_bytes(tok, V), int(time.time())

    async def completions(request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:  # not JSON, or not UTF-8
            raise BadRequest(f"the body is not valid JSON: {e}") from None
        # in a thread: a new set of stop strings reads the whole vocabulary, and a long prompt takes a while to encode
        requests, stream, include_usage = await asyncio.to_thread(parse, body, tok, V)
        job = Job(requests)
        worker.submit(job)
        await job.get()  # None once queued; a refused request raises here
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": name}
        texts = [Text(vocab, r.stop) for r in requests]
        usage = lambda: _usage(sum(len(r.prompt) for r in requests), sum(t.tokens for t in texts))
        choice = lambda i, text, finish: {"text": text, "index": i, "logprobs": None, "finish_reason": finish}
        if stream:
            async def events():
                async for i, event in _events(job, len(texts)):
                    text = texts[i].add(event.tokens, event.finish is not None)
                    if text or event.finish:
                        yield _sse({**head, "choices": [choice(i, text, event.finish)]})
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"

            return EventStream(events(), close=lambda: worker.cancel(job))
        pieces, finish = [[] for _ in texts], [None] * len(texts)

        async def collect():
            async for i, event in _events(job, len(texts)):
                pieces[i].append(texts[i].add(event.tokens, event.finish is not None))
                finish[i] = event.finish

        try:
            if not await _unless_disconnected(request, collect()):
                return Response(status_code=499)  # nginx's "client closed request": no one reads it
        finally:
            worker.cancel(job)
        choices = [choice(i, "".join(p), f) for i, (p, f) in enumerate(zip(pieces, finish))]
        return JSONResponse({**head, "choices": choices, "usage": usage()})

    async def models(request):
        card = {"id": name, "object": "model", "created": created, "owned_by": "efficient-zoo",
                "max_model_len": engine.max_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request):
        if worker.error is not None:
            return _error(503, f"the engine stopped: {type(worker.error).__name__}: {worker.error}", "server_error")
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        lines = [f"zoo_engine_{key} {value}" for key, value in worker.stats.items()]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(application):
        worker.thread.start()
        yield
        worker.close()

    async def bad_request(request, e: BadRequest):
        return _error(400, str(e), "invalid_request_error", e.param)

    async def http_error(request, e: HTTPException):  # 404, 405: Starlette's own
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error")

    async def server_error(request, e: Exception):
        return _error(500, f"{type(e).__name__}: {e}", "server_error")

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models),
              Route("/health", health), Route("/metrics", metrics)]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        BadRequest: bad_request, HTTPException: http_error, Exception: server_error})


async def _events(job: Job, n: int):
    """(choice index, Event) of the job's n requests until all have finished."""
    while n:
        i, event = await job.get()
        n -= event.finish is not None
        yield i, event


async def _unless_disconnected(request, work) -> bool:
    """Await coroutine `work` unless the client disconnects first; whether it finished (its error raised)."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(work), asyncio.ensure_future(gone())]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if tasks[0] in done:
        tasks[0].result()
    return tasks[0] in done


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description="Serve a model behind an "
                                "OpenAI-compatible HTTP endpoint (completions, streaming, health, metrics).")
    p.add_argument("source", help="a run folder (runs/NAME), a Hugging Face model folder (config.json, "
                   "*.safetensors, tokenizer.json) or a YAML config (random init)")
    p.add_argument("overrides", nargs="*", help="config overrides (dotted.key=value), only with a YAML config")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on; 0.0.0.0 for every interface, "
                   "behind a reverse proxy that authenticates (default: %(default)s, this machine only)")
    p.add_argument("--name", default=None, help="the model's id in requests and /v1/models (default: the source's "
                   "name)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="a Hugging Face folder's parameter and compute dtype (default: %(default)s)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="the most tokens of prompt plus max_tokens a request may have (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=16, help="prompt tokens fed per step, the prefix cache's block "
                   "(default: %(default)s)")
    p.add_argument("--prefill-rows", type=int, default=1, help="prompts fed per step (default: %(default)s)")
    p.add_argument("--tail", default="rollback", choices=("rollback", "decode"), help="a prompt's last, shorter "
                   "chunk rolled back, or fed one token a step beside the decoding slots (default: %(default)s)")
    p.add_argument("--prefix-cache-mb", type=float, default=0.0,
                   help="megabytes of prompt-prefix snapshots to reuse; 0: no prefix cache (default: %(default)s)")
    return p


def source_name(source: str) -> str:
    """A model's default id: its folder's name, or its config file's without .yaml."""
    return Path(source).name if Path(source).is_dir() else Path(source).stem


def main(argv=None):
    import uvicorn

    from infer.__main__ import load

    args = parser().parse_args(argv)
    try:
        model, tok, _ = load(args.source, args.overrides, args.dtype)
        application = app(model, tok, name=args.name or source_name(args.source), slots=args.slots,
                          max_len=args.max_len, chunk=args.chunk, prefill_rows=args.prefill_rows,
                          prefix_cache_mb=args.prefix_cache_mb, tail=args.tail)
    except ValueError as e:
        sys.exit(f"error: {e}")
    uvicorn.run(application, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
