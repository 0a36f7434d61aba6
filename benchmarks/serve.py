"""Serving under load: throughput, time to first token and per-token latency of infer.Engine per kind,
against the same requests served by static batches of infer.generate; memory per slot; the prefix cache.

    python -m benchmarks.serve [--kinds gqa sinks_window mamba2 ...] [--rates 8 16 32 64] [--requests 48]
                               [--d-model 256] [--layers 4] [--slots 8] [--chunk 32] [--prefill-rows 2]
                               [--prefix-rate 16] [--prefix-cache-mb 64] [--breakdown]
                               [--plot docs/serve_throughput.png]

Models: each kind of KINDS at --d-model and --layers, random weights, float32, vocabulary 256: the settings
of benchmarks/decode.py (sinks_window with gqa's 2 KV heads and `chunk` spare ring slots, which the engine's
rollback of a chunk needs) and a 3:1 hybrid of Gated DeltaNet and GQA layers. Random weights never emit a
stop token: every request runs to its max_tokens.

Workloads, seeded (--seed) and the same for every kind: (a) --requests requests with Poisson arrivals at
each rate of --rates (requests/s; one draw of unit-rate gaps, scaled by 1/rate, so every rate serves the
same requests), prompts of random tokens with lengths uniform in --prompt-len, outputs uniform in
--output-len; (b) shared prefixes at --prefix-rate: each prompt one of --prefixes random prefixes of
--prefix-len tokens (a system prompt) plus a unique suffix uniform in --suffix-len, outputs uniform in
--output-len, served with the prefix cache off and with --prefix-cache-mb.

The engine (slots, chunk, prefill_rows as given; max_len the workload's longest prompt + output) serves in
real time: a loop submits each request once the clock passes its arrival and calls engine.step()
otherwise; a token's time is that of the step that returned it. Where the engine is idle until the next
arrival, the clock jumps there instead of sleeping (nothing runs meanwhile, so the figures are those of
sleeping, without the wall time). Before timing, a throwaway engine of the same settings serves a few
requests (two of them sharing a block), which compiles every function the engine jits.

The static server runs infer.generate on batches in arrival order: a batch starts when the server is free
(or at the next arrival), takes up to `slots` requests that have arrived, and decodes the batch's largest
max_tokens rounded up to a multiple of 16 for every row. So that one compile serves each output length, the
batch is padded to `slots` rows of 1-token prompts (the engine too runs all its slots every step) and its
longest prompt lengthened with zeros to the workload's longest (generate pads every row to the batch's
longest: the work is that of padding, and random weights make the tokens irrelevant); a batch of a new
shape runs once untimed before it is timed. Its clock is simulated from the measured batch times; generate
does not stream, so a request's first token (and every other) comes at its batch's end, and only the
tokens each request asked for count.

Per kind and rate: generated tokens/s and completed requests/s from the first arrival to the last token;
time to first token (TTFT: first token - arrival) and per-token latency (engine: (last token - first
token) / (tokens - 1) per request; static: its batch's time / decode steps) at p50/p90/p99; the mean time
of one engine.step or one static decode step (ms/step). Memory: parameters, bytes per engine slot
(engine.slot_bytes) and the decode state of one sequence at each --contexts (jax.eval_shape of
init_state(1, L): nothing allocated), with how many fit --budget-gib. --breakdown times the parts of an
engine step against the same work done otherwise (`breakdown`). Prints the tables, writes
runs/bench/serve_{load,memory,prefix,breakdown}.json and the plot (throughput and TTFT p90 against
offered load; engine solid, static dashed) to --plot; docs/serving.md gives the command that wrote the
docs' figures.
"""

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import infer
from benchmarks import decode
from benchmarks.common import print_table, save_json, timeit
from infer import Engine, Request
from zoo import LanguageModel
from zoo.config import from_dict
from zoo.registry import MIXERS

KINDS = {"gqa": {"mixer": decode.KINDS["gqa"]},
         "sinks_window": {"mixer": {**decode.KINDS["sinks_window"], "num_kv_heads": 2}},  # gqa's KV heads
         **{k: {"mixer": decode.KINDS[k]} for k in ("mamba2", "gated_deltanet", "gla", "rwkv7")},
         "hybrid": {"layer_pattern": [decode.KINDS["gated_deltanet"]] * 3 + [decode.KINDS["gqa"]]}}  # Qwen3-Next's 3:1
VOCAB = 256
STEP_BUCKET = 16  # the static server's max_new_tokens: a multiple of this


def build(kind: str, d_model: int, layers: int, max_seq_len: int, chunk: int):
    """The model of a kind of KINDS, or of any registered mixer kind (benchmarks/decode.py's settings where it
    has them, else the kind's defaults); a ring cache (sinks_window) gets `chunk` spare slots: the engine's
    prefill rolls a chunk back (layers/attention.py, ring_spare)."""
    section = KINDS.get(kind) or {"mixer": decode.mixer(kind)}
    if section.get("mixer", {}).get("kind") == "attention" and "window" in section["mixer"]:
        section = {"mixer": {**section["mixer"], "ring_spare": max(16, chunk)}}
    cfg = from_dict({"model": {"d_model": d_model, "num_layers": layers, "max_seq_len": max_seq_len,
                               "vocab_size": VOCAB, **section}}).model
    return LanguageModel(cfg, rngs=nnx.Rngs(0))


def workload(rng, n: int, prompt_len, output_len, prefixes: list | None = None) -> tuple[np.ndarray, list]:
    """Unit-rate Poisson arrival times (n,) and n requests: random prompts of lengths uniform in prompt_len
    (inclusive), each after a prefix drawn from `prefixes` when given; outputs uniform in output_len."""
    arrivals = np.cumsum(rng.exponential(1.0, n))
    requests = []
    for _ in range(n):
        prompt = rng.integers(0, VOCAB, rng.integers(prompt_len[0], prompt_len[1] + 1)).tolist()
        if prefixes:
            prompt = prefixes[rng.integers(len(prefixes))] + prompt
        requests.append(Request(prompt, int(rng.integers(output_len[0], output_len[1] + 1))))
    return arrivals - arrivals[0], requests


def serve(engine: Engine, arrivals: np.ndarray, requests: list[Request]) -> tuple[list[dict], float]:
    """Serve the requests through `engine` as they arrive (module docstring); returns per request its arrival,
    first token and last token times (s) and its token count, and the mean seconds of one engine.step."""
    times = [[] for _ in requests]
    index, skipped, busy, i = {}, 0.0, 0.0, 0
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start + skipped
    while i < len(requests) or not engine.idle:
        now = clock()
        while i < len(requests) and arrivals[i] <= now:
            index[engine.submit(requests[i])] = i
            i += 1
        if engine.idle:
            skipped += arrivals[i] - now  # nothing to run before the next arrival: the clock jumps there
            continue
        events = engine.step()
        busy += clock() - now
        now = clock()
        for e in events:
            times[index[e.rid]] += [now] * len(e.tokens)
    for t, r in zip(times, requests):
        assert len(t) == r.max_tokens, "random weights never stop: every request runs to max_tokens"
    rows = [dict(arrival=a, first=t[0], finish=t[-1], tokens=len(t), per_token=(t[-1] - t[0]) / max(len(t) - 1, 1))
            for a, t in zip(arrivals.tolist(), times)]
    return rows, busy / engine.steps


def static(model, arrivals: np.ndarray, requests: list[Request], slots: int) -> tuple[list[dict], float]:
    """The same requests through static batches of infer.generate (module docstring); the same rows as `serve`
    and the mean seconds of one decode step."""
    P = max(len(r.prompt) for r in requests)
    rows, free, i, compiled, seconds, steps = [], 0.0, 0, set(), 0.0, 0
    while i < len(requests):
        begin = max(free, arrivals[i])
        j = i + 1
        while j < len(requests) and j - i < slots and arrivals[j] <= begin:
            j += 1
        batch = requests[i:j]
        N = -(-max(r.max_tokens for r in batch) // STEP_BUCKET) * STEP_BUCKET
        longest = max(range(len(batch)), key=lambda k: len(batch[k].prompt))
        prompts = [list(r.prompt) for r in batch] + [[0]] * (slots - len(batch))
        prompts[longest] = [0] * (P - len(prompts[longest])) + prompts[longest]
        if N not in compiled:
            infer.generate(model, prompts, max_new_tokens=N)
            compiled.add(N)
        t = time.perf_counter()
        infer.generate(model, prompts, max_new_tokens=N)
        took = time.perf_counter() - t
        free = begin + took
        seconds, steps = seconds + took, steps + N
        rows += [dict(arrival=float(a), first=free, finish=free, tokens=r.max_tokens, per_token=took / N)
                 for a, r in zip(arrivals[i:j], batch)]
        i = j
    return rows, seconds / steps


def percentiles(values) -> str:
    return " / ".join(f"{v:.1f}" if v < 100 else f"{v:.0f}" for v in np.percentile(1000 * np.asarray(values),
                                                                                  [50, 90, 99]))


def summary(rows: list[dict], step_seconds: float) -> dict:
    """Throughput and latency of one served workload (ms; the percentiles as "p50 / p90 / p99")."""
    span = max(r["finish"] for r in rows) - min(r["arrival"] for r in rows)
    ttft, per_token = [r["first"] - r["arrival"] for r in rows], [r["per_token"] for r in rows]
    return {"tok/s": round(sum(r["tokens"] for r in rows) / span), "req/s": round(float(len(rows) / span), 1),
            "TTFT ms p50/p90/p99": percentiles(ttft), "ms/token p50/p90/p99": percentiles(per_token),
            "ms/step": round(float(1000 * step_seconds), 2), "ttft_p90_ms": float(np.percentile(ttft, 90)) * 1000}


def warm(engine: Engine, rng):
    """Compile the engine's functions by serving a few requests: prefill with and without decoding beside it, a
    reset slot, and (with a prefix cache) a block taken and put back."""
    block = rng.integers(0, VOCAB, engine.chunk).tolist()
    engine.run([Request(block + [1, 2], 2), Request([4], 2)])
    engine.run([Request(block + [5], 2)])


def best_ms(fn, repeats: int = 20) -> float:
    """The least milliseconds of `repeats` timed runs of fn() after one untimed (compile) run: on a shared
    machine other work only ever adds time."""
    jax.block_until_ready(fn())
    return 1000 * min(timeit(fn, repeats=1, warmup=False) for _ in range(repeats))


def breakdown(model, max_len: int, slots: int, chunk: int, prefill_rows: int, tail: str = "rollback") -> dict:
    """Where an engine step's time goes, against the same work done otherwise (ms, public APIs only): one
    prefill chunk (prefill_rows, chunk) through model.decode plain (the layers' prefill forms, as the engine
    feeds full chunks) and with steps=True then rolled back (as it feeds a prompt's last, shorter chunk); a
    decode-only engine.step with every slot decoding, a bare jitted model.decode of the same (slots, 1)
    tokens with argmax, and one step of infer.generate's loop at batch `slots` (the time of 64 new tokens
    less that of 32, / 32)."""
    graphdef, params = nnx.split(model)
    max_len = max(max_len, 64)  # room for the timed steps
    R, C, B, size = prefill_rows, chunk, slots, max_len + chunk

    @functools.partial(jax.jit, static_argnames="steps")
    def prefill(params, tokens, state, steps: bool):
        m = nnx.merge(graphdef, params)
        logits, state = m.decode(tokens, state, steps=steps)
        return logits[:, -1], m.rollback(state, jnp.zeros((R,), jnp.int32)) if steps else state

    @jax.jit
    def decode(params, tokens, state):
        logits, state = nnx.merge(graphdef, params).decode(tokens, state)
        return jnp.argmax(logits[:, -1], axis=-1), state

    chunk, state = jnp.ones((R, C), jnp.int32), model.init_state(R, size)
    row = {f"prefill {R}x{C}": best_ms(lambda: prefill(params, chunk, state, False)),
           f"prefill {R}x{C} rolled back": best_ms(lambda: prefill(params, chunk, state, True))}
    engine = Engine(model, max_len=max_len, slots=B, chunk=C, prefill_rows=R, tail=tail)
    for _ in range(B):
        engine.submit(Request([1], max_len - 1))
    while engine.stats()["prefill_tokens"] < B:  # until every slot decodes
        engine.step()
    row["engine decode step"] = best_ms(engine.step)
    tokens, state = jnp.ones((B, 1), jnp.int32), model.init_state(B, size)
    row["bare decode step"] = best_ms(lambda: decode(params, tokens, state))
    prompts = [[1]] * B
    new = [best_ms(lambda: infer.generate(model, prompts, max_new_tokens=n), 5) for n in (32, 64)]
    row["generate step"] = (new[1] - new[0]) / 32
    return {k: round(v, 2) for k, v in row.items()}


def state_bytes(model, context: int) -> int:
    shapes = jax.eval_shape(lambda: model.init_state(1, context))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def plot(rows: list[dict], path: Path):
    """Throughput and TTFT p90 against offered load, a colour per kind, engine solid and static dashed; skipped
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plot]'): no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for k, kind in enumerate(kinds):
        for server, style in (("engine", "-"), ("static", "--")):
            mine = [r for r in rows if r["kind"] == kind and r["server"] == server]
            x = [r["rate"] for r in mine]
            left.plot(x, [r["tok/s"] for r in mine], style, color=f"C{k}", marker="o", ms=3,
                      label=kind if server == "engine" else None)
            right.plot(x, [r["ttft_p90_ms"] for r in mine], style, color=f"C{k}", marker="o", ms=3)
    offered = sorted({(r["rate"], r["offered tok/s"]) for r in rows})
    left.plot(*zip(*offered), ":", color="grey", label="offered")
    rates = sorted({r["rate"] for r in rows})
    for ax, label in ((left, "generated tokens/s"), (right, "time to first token, p90 (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xticks([], minor=True)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
    left.legend(fontsize=7, title="engine solid, static dashed", title_fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=[*KINDS, *MIXERS],
                   help="kinds of KINDS or any registered mixer kind (default: KINDS)")
    p.add_argument("--rates", type=float, nargs="+", default=[8, 16, 32, 64], help="requests/s")
    p.add_argument("--requests", type=int, default=48, help="requests per rate and in the shared-prefix workload")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 64])
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, nargs=2, default=[16, 64])
    p.add_argument("--prefix-rate", type=float, default=16)
    p.add_argument("--prefix-cache-mb", type=float, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--prefill-rows", type=int, default=2)
    p.add_argument("--tail", default="rollback", choices=("rollback", "decode"), help="infer.Engine's tail")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--budget-gib", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true", help="also time the parts of an engine step (`breakdown`)")
    p.add_argument("--plot", type=Path, default=Path("runs/bench/serve_throughput.png"))
    return p


def workloads(args) -> dict:
    """The seeded requests every kind serves: unit-rate arrivals and requests of the load workload and of the
    shared-prefix one, and the max_len each needs."""
    rng = np.random.default_rng(args.seed)
    unit, requests = workload(rng, args.requests, args.prompt_len, args.output_len)
    prefixes = [rng.integers(0, VOCAB, args.prefix_len).tolist() for _ in range(args.prefixes)]
    shared_unit, shared = workload(rng, args.requests, args.suffix_len, args.output_len, prefixes)
    max_len, shared_max_len = (max(len(r.prompt) + r.max_tokens for r in rs) for rs in (requests, shared))
    return dict(rng=rng, unit=unit, requests=requests, shared_unit=shared_unit, shared=shared, max_len=max_len,
                shared_max_len=shared_max_len, mean_output=float(np.mean([r.max_tokens for r in requests])))


def measure(kind: str, args, w: dict, prefix_cache: bool = True) -> dict:
    """One kind's rows: load (engine and static at each rate), memory, and (prefix_cache) the shared-prefix
    workload without and with the prefix cache, and (args.breakdown) the breakdown."""
    settings = dict(slots=args.slots, chunk=args.chunk, prefill_rows=args.prefill_rows, tail=args.tail)
    max_len, shared_max_len, rng = w["max_len"], w["shared_max_len"], w["rng"]
    model = build(kind, args.d_model, args.layers, max(*args.contexts, max_len, shared_max_len), args.chunk)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    warm(Engine(model, max_len=max_len, **settings), rng)
    load, prefix, parts = [], [], []
    for rate in args.rates:
        arrivals = w["unit"] / rate
        engine = Engine(model, max_len=max_len, **settings)
        for server, (rows, step) in (("engine", serve(engine, arrivals, w["requests"])),
                                     ("static", static(model, arrivals, w["requests"], args.slots))):
            load.append({"kind": kind, "server": server, "rate": rate,
                         "offered tok/s": round(rate * w["mean_output"]), **summary(rows, step)})
            print(load[-1], flush=True)
    memory = {"kind": kind, "params": params, "slot KiB": engine.slot_bytes // 1024,
              **{k: v for L in args.contexts for k, v in (
                  (f"KiB at {L}", state_bytes(model, L) // 1024),
                  (f"slots in {args.budget_gib:g} GiB at {L}", int(args.budget_gib * 2**30 // state_bytes(model, L))))}}
    for mb in (0, args.prefix_cache_mb) if prefix_cache else ():
        warm(Engine(model, max_len=shared_max_len, prefix_cache_mb=mb, **settings), rng)
        engine = Engine(model, max_len=shared_max_len, prefix_cache_mb=mb, **settings)
        rows, step = serve(engine, w["shared_unit"] / args.prefix_rate, w["shared"])
        stats = engine.stats()
        prefix.append({"kind": kind, "prefix cache MB": mb, **summary(rows, step),
                       "prefill tokens": stats["prefill_tokens"],
                       "reused tokens": stats["prefix_cache_reused_tokens"],
                       "hits": f"{stats['prefix_cache_hits']}/{stats['prefix_cache_lookups']}"})
        print(prefix[-1], flush=True)
    if args.breakdown:
        parts.append({"kind": kind, **breakdown(model, max_len, **settings)})
        print(parts[-1], flush=True)
    return dict(load=load, memory=[memory], prefix=prefix, breakdown=parts)


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    w = workloads(args)
    out = {"load": [], "memory": [], "prefix": [], "breakdown": []}
    for kind in args.kinds:
        for key, rows in measure(kind, args, w).items():
            out[key] += rows
    load, memory, prefix, parts = out["load"], out["memory"], out["prefix"], out["breakdown"]
    mean_output = w["mean_output"]
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}; d_model {args.d_model}, {args.layers} "
          f"layers, float32; engine slots={args.slots} chunk={args.chunk} prefill_rows={args.prefill_rows}")
    print(f"\nPoisson arrivals, {args.requests} requests per rate, prompts uniform in {args.prompt_len}, outputs "
          f"uniform in {args.output_len} (mean {mean_output:.1f})")
    print_table(load, ["kind", "server", "rate", "offered tok/s", "tok/s", "req/s", "TTFT ms p50/p90/p99",
                       "ms/token p50/p90/p99", "ms/step"])
    print(f"\nmemory: decode state per sequence; slots that fit {args.budget_gib:g} GiB (weights not counted)")
    print_table(memory, list(memory[0]))
    print(f"\nshared prefixes at {args.prefix_rate:g} requests/s: {args.prefixes} prefixes of {args.prefix_len} "
          f"tokens + suffixes uniform in {args.suffix_len}")
    print_table(prefix, ["kind", "prefix cache MB", "tok/s", "req/s", "TTFT ms p50/p90/p99", "ms/token p50/p90/p99",
                         "ms/step", "prefill tokens", "reused tokens", "hits"])
    if parts:
        print("\nwhere an engine step's time goes (ms, least of 20 runs; `breakdown`)")
        print_table(parts, list(parts[0]))
        save_json("serve_breakdown", parts)
    save_json("serve_load", load)
    save_json("serve_memory", memory)
    save_json("serve_prefix", prefix)
    plot(load, args.plot)
    return out


if __name__ == "__main__":
    main()
