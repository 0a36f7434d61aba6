"""What early exit buys and costs, on a model trained with exits (configs/early_exit.yaml).

    python -m train configs/early_exit.yaml && python -m benchmarks.early_exit runs/early_exit

1. Quality against depth: validation text is fed token by token through the exit decoder (teacher
   forcing, so every setting sees the same text) at a sweep of thresholds for each measure. For each
   setting: the mean layers used, agreement (the chosen token equals the full model's greedy token),
   and the validation loss of the chosen exit's distribution, in nats per byte. Two ways of keeping the
   skipped layers' state are compared: `propagate` (the decoder's choice: later blocks run on the
   exited hidden state) and `full_state` (the later blocks' states come from the full-depth hidden
   states, an ideal that saves nothing and shows what propagation costs).
2. Speed: tokens/s of a fixed depth per sequence (the layers past it are skipped) against plain
   greedy, batch 1 (speculative decoding has its own benchmark: benchmarks/speculative.py).
3. Token-level exit speed: greedy tokens/s against mean layers used, softmax and margin at several
   thresholds, batch 1 and 8, for the two ways of advancing the layers a token skips, which give the same
   tokens: `every block` (each block runs in full on the exited hidden state, output discarded) and
   `state only` (the decoder's way: once every row has exited, a block only advances its state). All
   settings in one run, interleaved, best of --repeats, in wall time and in CPU time (the steadier on a
   shared machine). `batch layers` is the mean over tokens of the deepest row's layers: the depth the
   batch runs in full.

Writes runs/bench/early_exit.json and runs/bench/early_exit.png (layers used against agreement and loss).
`--sections token_speed` runs only section 3 (any subset of quality, speed, token_speed).
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import infer
from benchmarks.common import print_table, save_json
from infer import early_exit
from train.prepare import prepare
from zoo.checkpoint import load_model

THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "measure", "propagate"))
def teacher_forced(graphdef, params, tokens, threshold, *, measure: str, propagate: bool):
    """Chosen logits (B, T, V) and layers used (B, T) when feeding `tokens` one at a time."""
    model = nnx.merge(graphdef, params)
    model.eval()
    rule = early_exit.confident(model, measure, threshold)

    def step(state, tok):
        logits, used, state = early_exit.exit_pass(model, tok[:, None], state, stop_rule=rule, freeze=propagate)
        return state, (logits, used)

    state = model.init_state(tokens.shape[0], tokens.shape[1])
    _, (logits, used) = jax.lax.scan(step, state, tokens.T)
    return logits.transpose(1, 0, 2), used.T


def quality(graphdef, params, x, y, full_top):
    rows = []
    for measure in early_exit.MEASURES:
        for propagate in (True, False):
            for threshold in THRESHOLDS:
                logits, used = teacher_forced(graphdef, params, x, jnp.float32(threshold), measure=measure,
                                              propagate=propagate)
                rows.append({"measure": measure, "state": "propagate" if propagate else "full_state",
                             "threshold": threshold, "layers": round(float(used.mean()), 3),
                             "agreement": round(float((jnp.argmax(logits, -1) == full_top).mean()), 4),
                             "val_loss": round(float(
                                 optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()), 4)})
                print(rows[-1], flush=True)
    return rows


def tokens_per_s(model, prompt, new_tokens, repeats=3, **kwargs):
    out = infer.generate(model, [prompt], max_new_tokens=new_tokens, return_info=True, **kwargs)  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        infer.generate(model, [prompt], max_new_tokens=new_tokens, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return len(out[0][0]) / best, out


def speed(model, prompt, new_tokens):
    base, _ = tokens_per_s(model, prompt, new_tokens)
    rows = [{"decoding": "greedy", "layers": model.cfg.num_layers, "tokens_per_s": round(base, 1), "vs_greedy": 1.0}]
    tps, _ = tokens_per_s(model, prompt, new_tokens, exits=infer.Exits(0.0, level="sequence"))
    rows.append({"decoding": "depth per sequence", "layers": model.exit_layers[0], "tokens_per_s": round(tps, 1),
                 "vs_greedy": round(tps / base, 2)})  # threshold 0: every sequence stops at the first exit
    return rows


TOKEN_THRESHOLDS = {"softmax": (0.0, 0.5, 0.7, 0.9, 0.95), "margin": (0.5, 0.7, 0.9, 0.95)}  # 0: the first exit


def token_speed(model, prompts, new_tokens, repeats=5):
    """Section 3: rows for batch len(prompts) (see the module docstring). Each setting's best wall time, and
    its best CPU time of this process (all its threads): on a shared machine the steadier measure of work."""
    L = model.cfg.num_layers
    settings = {("greedy", None, None): {}}
    for measure, thresholds in TOKEN_THRESHOLDS.items():
        for threshold in thresholds:
            for full in (True, False):
                settings[(measure, threshold, full)] = dict(exits=infer.Exits(threshold, measure=measure,
                                                                              full_blocks=full))
    outs = {key: infer.generate(model, prompts, max_new_tokens=new_tokens, return_info=True, **kw)
            for key, kw in settings.items()}  # compiles (the threshold is traced: one per measure and path)
    wall, cpu = dict.fromkeys(settings, float("inf")), dict.fromkeys(settings, float("inf"))
    for _ in range(repeats):  # interleaved: a slow spell of a shared machine hits every setting alike
        for key, kw in settings.items():
            t0, c0 = time.perf_counter(), time.process_time()
            infer.generate(model, prompts, max_new_tokens=new_tokens, **kw)
            wall[key] = min(wall[key], time.perf_counter() - t0)
            cpu[key] = min(cpu[key], time.process_time() - c0)
    count = sum(len(r) for r in outs[("greedy", None, None)][0])
    tps = lambda key: (count / wall[key], count / cpu[key])
    greedy, greedy_cpu = tps(("greedy", None, None))
    rows = [{"batch": len(prompts), "decoding": "greedy", "layers": L, "batch_layers": L,
             "tokens_per_s": round(greedy, 1), "tokens_per_cpu_s": round(greedy_cpu, 1)}]
    for (measure, threshold, full), (out, info) in outs.items():
        if measure == "greedy" or full:
            continue
        ref, ref_info = outs[(measure, threshold, True)]
        assert out == ref and info == ref_info, "both ways of advancing skipped layers must give the same tokens"
        used = np.asarray(info["exit_layers"])  # (B, new_tokens): no stop token, every row is full
        (old, old_cpu), (new, new_cpu) = tps((measure, threshold, True)), tps((measure, threshold, False))
        rows.append({"batch": len(prompts), "decoding": measure, "threshold": threshold,
                     "layers": round(float(used.mean()), 3), "batch_layers": round(float(used.max(0).mean()), 3),
                     "every_block": round(old, 1), "state_only": round(new, 1), "vs_greedy": round(new / greedy, 2),
                     "vs_every_block": round(new / old, 2), "every_block_cpu": round(old_cpu, 1),
                     "state_only_cpu": round(new_cpu, 1), "cpu_vs_greedy": round(new_cpu / greedy_cpu, 2),
                     "cpu_vs_every_block": round(new_cpu / old_cpu, 2)})
        print(rows[-1], flush=True)
    return rows


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for measure in early_exit.MEASURES:
        for state, style in (("propagate", "-o"), ("full_state", ":x")):
            sel = [r for r in rows if r["measure"] == measure and r["state"] == state]
            for ax, key in zip(axes, ("agreement", "val_loss")):
                ax.plot([r["layers"] for r in sel], [r[key] for r in sel], style, label=f"{measure} ({state})", ms=3)
    for ax, key in zip(axes, ("agreement with the full model", "validation loss (nats/byte)")):
        ax.set_xlabel("mean layers used")
        ax.set_ylabel(key)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", help="a run trained with model.exits, e.g. runs/early_exit")
    p.add_argument("--rows", type=int, default=8, help="validation windows")
    p.add_argument("--length", type=int, default=256, help="bytes per window")
    p.add_argument("--new-tokens", type=int, default=256, help="generated bytes in the speed test")
    p.add_argument("--sections", nargs="+", choices=("quality", "speed", "token_speed"),
                   default=["quality", "speed", "token_speed"])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per setting in token_speed (the best)")
    args = p.parse_args()
    cfg, model, step = load_model(args.run_dir)
    if not model.exit_layers:
        raise SystemExit(f"{args.run_dir} has no exits (model.exits); train configs/early_exit.yaml first")
    model.eval()
    batch = prepare(cfg.data).batches(seq_len=args.length, seed=0, packing=False).val_batch(0, args.rows)
    x, y = jnp.asarray(batch["x"]), jnp.asarray(batch["y"])
    graphdef, params = nnx.split(model)
    print(f"\n{args.run_dir} step {step}; device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows, fast, token = [], [], []
    if "quality" in args.sections:
        full_top = jnp.argmax(nnx.jit(lambda m, t: m(t))(model, x), -1)
        rows = quality(graphdef, params, x, y, full_top)
        print(f"\n{args.rows} validation windows x {args.length} bytes, fed one at a time")
        print_table(rows, ["measure", "state", "threshold", "layers", "agreement", "val_loss"])
        plot(rows, "runs/bench/early_exit.png")
    prompts = [[int(t) for t in np.asarray(row[:32])] for row in x]
    if "speed" in args.sections:
        fast = speed(model, prompts[0], args.new_tokens)
        print(f"\nbatch 1, {args.new_tokens} new bytes after a 32-byte prompt; best of 3")
        print_table(fast, ["decoding", "layers", "tokens_per_s", "vs_greedy", "acceptance"])
    if "token_speed" in args.sections:
        for batch in (1, 8):
            token += token_speed(model, (prompts * 8)[:batch], args.new_tokens, args.repeats)
        print(f"\ntoken-level exit, greedy, {args.new_tokens} new bytes after 32-byte prompts; best of {args.repeats}, "
              "interleaved; tokens/s of every block and of state only (the decoder's), and the ratios in CPU time")
        print_table(token, ["batch", "decoding", "threshold", "layers", "batch_layers", "tokens_per_s", "every_block",
                            "state_only", "vs_greedy", "vs_every_block", "cpu_vs_greedy", "cpu_vs_every_block"])
    save_json("early_exit", rows + fast + token)


if __name__ == "__main__":
    main()
