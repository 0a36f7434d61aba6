"""Speculative decoding against plain decoding, in wall time, on a model whose decode step is weight-bound.

    python -m train configs/speculative.yaml && python -m train configs/draft.yaml
    python -m benchmarks.speculative runs/speculative --draft runs/draft

First the premise: how much a verify pass of k + 1 tokens costs against a one-token step of the target
(jitted decode from a prefilled cache, best of 20). Then tokens/s of greedy decoding, self-speculation
(the target's first layers and their exit) and draft-model speculation, chains of several k and token
trees, at batch 1 and 8 (prompts: held-out text), and sampled speculation against plain sampling
(temperature 0.8). Every setting runs `repeats` times, interleaved with the others, and keeps its
best, so the ratios compare runs made under the same load. Greedy settings are checked to give plain
greedy decoding's tokens. Writes runs/bench/speculative.json.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import infer
from benchmarks.common import print_table, save_json
from train.prepare import prepare
from zoo.checkpoint import load_model


def pass_cost(model, ks, context: int = 64, repeats: int = 20) -> dict:
    """ms of one target decode call of T tokens from a prefilled cache, for T = 1 and k + 1."""
    graphdef, params = nnx.split(model)
    decode = jax.jit(lambda p, t, s: nnx.merge(graphdef, p).decode(t, s, steps=True))
    _, state = jax.jit(lambda p, t, s: nnx.merge(graphdef, p).decode(t, s))(
        params, jnp.zeros((1, context), jnp.int32), model.init_state(1, context + 16))
    ms = {}
    for T in (1, *(k + 1 for k in ks)):
        tokens = jnp.zeros((1, T), jnp.int32)
        jax.block_until_ready(decode(params, tokens, state))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(decode(params, tokens, state))
            best = min(best, time.perf_counter() - t0)
        ms[T] = best * 1e3
    return ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", help="the target: a run trained with exits (configs/speculative.yaml)")
    p.add_argument("--draft", help="a draft model's run (configs/draft.yaml)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = p.parse_args()
    cfg, model, step = load_model(args.run_dir)
    draft = load_model(args.draft)[1] if args.draft else None
    cost = pass_cost(model, args.ks)
    print(f"{args.run_dir} step {step} (d_model {cfg.model.d_model}, {cfg.model.num_layers} layers); "
          f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("verify pass / one-token step: " + ", ".join(f"{T} tokens {ms / cost[1]:.2f}x ({ms:.2f} ms)"
                                                      for T, ms in cost.items()))
    windows = prepare(cfg.data).batches(seq_len=args.prompt_length, seed=0,
                      packing=False).val_batch(0, max(args.batches))["x"]  # held-out text

    settings = [("greedy", {})]
    spec = lambda *a, **kw: {"speculation": infer.Speculation(*a, **kw)}
    settings += [(f"self k={k} (layers {d})", spec(k, draft_layers=d)) for d in model.exit_layers[-2:] for k in args.ks]
    settings += [(f"self k=4 tree {t}", spec(4, draft_layers=model.exit_layers[-1], tree=t)) for t in ((2,), (2, 2))]
    if draft is not None:
        settings += [(f"draft k={k}", spec(k, draft_model=draft)) for k in args.ks]
        settings += [(f"draft k=4 tree {t}", spec(4, draft_model=draft, tree=t)) for t in ((2,), (2, 2))]
    sampled = [("sampling", {}), ("sampling, self k=4", spec(4, draft_layers=model.exit_layers[-1]))]
    if draft is not None:
        sampled.append(("sampling, draft k=4", spec(4, draft_model=draft)))
    settings += [(name, {**kw, "sampling": infer.Sampling(0.8)}) for name, kw in sampled]

    rows = []
    for B in args.batches:
        prompts = [[int(t) for t in w] for w in np.asarray(windows[:B])]
        best, info, outs = {}, {}, {}
        for name, kw in settings:  # compile, and the tokens / acceptance of each setting
            outs[name], info[name] = infer.generate(model, prompts, max_new_tokens=args.new_tokens, return_info=True,
                                                    **kw)
        for _ in range(args.repeats):
            for name, kw in settings:
                t0 = time.perf_counter()
                infer.generate(model, prompts, max_new_tokens=args.new_tokens, **kw)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
        for name, kw in settings:
            if "sampling" not in kw:
                assert outs[name] == outs["greedy"], f"{name}: speculation must give greedy decoding's tokens"
            base = "sampling" if "sampling" in kw else "greedy"
            tps = B * args.new_tokens / best[name]
            rows.append({"batch": B, "decoding": name, "tokens_per_s": round(tps, 1),
                         "vs_plain": round(best[base] / best[name], 2),
                         "acceptance": round(info[name]["acceptance"], 3) if "acceptance" in info[name] else ""})
            print(rows[-1], flush=True)
    print()
    print_table(rows, ["batch", "decoding", "tokens_per_s", "vs_plain", "acceptance"])
    save_json("speculative", [{"pass_ms": cost}] + rows)


if __name__ == "__main__":
    main()
