"""Context parallelism on 8 simulated CPU devices, per kind with a context-parallel form: what the context
axis sends, the activation memory it saves per device, and the longest sequence a memory budget trains.

    python -m benchmarks.context [--kinds gla mamba2 ...] [--seq-len 2048] [--budget-mb 256] [--search gla]
                                 [--time gla] [--d-model 64] [--layers 2] [--batch 1]

Models: each kind's configs/<kind>.yaml (the kind's defaults where there is none) at --d-model and --layers,
--batch rows of --seq-len tokens (no packing: no segment ids), model.max_seq_len LONGEST, the training step of
train/step.py (forward, backward, AdamW) for the mesh of one device and for train.mesh.context=8. Each step is
compiled, not run: the figures are read from the compiled program, per device.

- exchange: the collectives of the compiled step, by the bytes of their results: the all-reduces, per step
  (the gradients of the parameters every device holds, and the loss; XLA merges them into one op, whose name
  joins those of its parts, so they are told apart by op alone); the others inside a shard_map, per layer
  (kernels/context.py: scan_devices' all-gather of every device's (M, S_loc) and, in the backward pass, its
  transpose, a reduce-scatter; from_left's permutes of the windows; attention's all-gathered keys); and those
  XLA placed in the layers itself, per layer (`other`: resharding it chose). Beside them the analytic figure
  of the recurrent exchanges, recorded while tracing (`recording`): (n + 1) times the bytes of (M, S_loc) a
  device makes (n in the forward all-gather's result, one in the backward reduce-scatter's), twice a window.
- memory: compiled.memory_analysis(): temp (the activations kept for the backward pass and the scratch of
  the step), arguments and outputs, at --seq-len on both meshes.
- longest: the longest T (a multiple of 8 x the kind's chunk_size, 64 where it has none) whose footprint
  (arguments + outputs - donated + temp) is within --budget-mb per device, on each mesh, for the kinds of
  --search (`all`: every kind): each probe a compile, the next T where the line through the last two probes
  meets the budget.
- time: for the kinds of --time, the median of --steps executed steps on one device and on the 8 simulated
  devices. These share this machine's cores, so the ratio is no speed-up figure: it shows the cost of the
  exchange and the partitioning on top of the same total work.

Compiles for the figures use XLA's cheapest CPU code generation (FAST, as tests/conftest.py), four times
faster: the same collectives as the default's and temp within 0.1% (gla, mamba2, rwkv7 compared); the timed
steps compile with the defaults. Prints the tables, writes
runs/bench/context_{exchange,memory,longest,time}.json; docs/context.md gives the command of its figures.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import print_table, save_json  # noqa: E402
from kernels import context  # noqa: E402
from train import optim  # noqa: E402
from train.step import forward, make_train_step  # noqa: E402
from zoo import load_config  # noqa: E402
from zoo.config import MeshConfig, apply_overrides, from_dict  # noqa: E402
from zoo.registry import LAYER_OF, MIXERS  # noqa: E402
from zoo.sharding import as_numpy, batch_sharding, check_context, init_state, make_mesh  # noqa: E402

N = 8  # devices on the context axis
LONGEST = 1 << 20  # the model's max_seq_len, and the longest T the search tries
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
        "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-reduce|reduce-scatter|collective-permute|"
                        r"all-to-all)\(")
ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
BYTES = {"c128": 16, "c64": 8, "f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
         "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def supported() -> list[str]:
    """The registered mixer kinds whose layer has a context-parallel form."""
    return [k for k, c in MIXERS.items() if LAYER_OF[c].context_parallel]


def config(kind: str, args, context_size: int):
    """The kind's run file (configs/<kind>.yaml, else its defaults) at the benchmark's sizes."""
    sizes = {"model.d_model": args.d_model, "model.num_layers": args.layers, "model.max_seq_len": LONGEST,
             "train.batch_size": args.batch, "train.grad_accum": 1, "train.seq_len": args.seq_len,
             "train.mesh.data": 1, "train.mesh.context": context_size}
    overrides = [f"{k}={v}" for k, v in sizes.items()]
    path = Path("configs") / f"{kind}.yaml"
    if path.is_file():
        return load_config(path, overrides)
    return from_dict(apply_overrides({"model": {"mixer": {"kind": kind}}}, overrides))


def collectives(hlo: str) -> list[tuple[str, int, bool]]:
    """(op, bytes of its result, inside a shard_map) of every collective of a compiled program's text."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.match(line)
        if m:
            size = sum(BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in
                       ARRAY.findall(m[1]))
            out.append((m[2], size, "/shard_map/" in line))
    return out


@contextlib.contextmanager
def recording(sent: list):
    """Within: every exchange of kernels/context.py traced appends (what, shapes, bytes a device receives in a
    forward and backward pass): scan_devices' all-gather of every device's (transition, state), n of each and
    one back in the reduce-scatter of the gradient; from_left's ppermute of a window, one each way."""
    scan, left = context.scan_devices, context.from_left
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    shapes = lambda tree: "+".join("x".join(map(str, x.shape)) for x in jax.tree.leaves(tree))

    def spy_scan(M, S_loc, *args):
        sent.append(("state", shapes((M, S_loc)), (N + 1) * nbytes((M, S_loc))))
        return scan(M, S_loc, *args)

    def spy_left(x, *args):
        sent.append(("window", shapes(x), 2 * nbytes(x)))
        return left(x, *args)

    with mock.patch.object(context, "scan_devices", spy_scan), mock.patch.object(context, "from_left", spy_left):
        yield


class Setup:
    """One kind on one mesh: its initialised state and step, compiled on demand at any sequence length."""

    def __init__(self, kind: str, args, context_size: int):
        self.kind, self.args = kind, args
        self.cfg = config(kind, args, context_size)
        self.mesh = make_mesh(MeshConfig(data=1, context=context_size), devices=jax.devices()[:context_size])
        check_context(self.cfg, self.mesh)
        self.programs = {}  # T -> the compiled step
        self.chunk = max(getattr(m, "chunk_size", 64) for m in self.cfg.model.mixers())
        with jax.set_mesh(self.mesh):
            tx = optim.optimizer(self.cfg.train)
            self.graphdef, self.params, self.rest, self.opt_state, shardings = init_state(self.cfg, tx, self.mesh)
            self.step = make_train_step(self.graphdef, tx, (*shardings, jax.sharding.NamedSharding(self.mesh, jax.P())))

    def batch(self, T: int, micro: bool = True) -> dict:
        """Abstract batch of T tokens a row, placed as batch_placer places it: (1, B, T), or (B, T) without `micro`."""
        shape = (1, self.args.batch, T) if micro else (self.args.batch, T)
        sharding = batch_sharding(self.mesh, len(shape), axis=len(shape) - 2, time=True)
        return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for name, dtype in (("x", jnp.int32), ("y", jnp.int32), ("mask", jnp.float32))}

    def compiled(self, T: int):
        """The step compiled (FAST) for batches of T tokens a row; once per T."""
        if T not in self.programs:
            with jax.set_mesh(self.mesh):
                self.programs[T] = self.step.func.lower(self.params, self.rest, self.opt_state, self.batch(T),
                                                        **self.step.keywords).compile(compiler_options=FAST)
        return self.programs[T]

    def footprint(self, T: int) -> int:
        """Bytes a device holds while running the step at T: arguments + outputs - donated + temp."""
        m = self.compiled(T).memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes

    def exchanged(self, T: int) -> list[tuple]:
        """What the exchanges of kernels/context.py send at T (`recording`)."""
        states = []
        with jax.set_mesh(self.mesh), recording(states):
            jax.eval_shape(lambda p, r, b: forward(self.graphdef, p, r, b, True), self.params, self.rest,
                           self.batch(T, micro=False))
        return states


def longest(footprint, unit: int, budget: int) -> int:
    """The longest multiple of `unit` (up to LONGEST) whose footprint(T) is within `budget`, 0 if none:
    footprint grows with T, close to a line, so each probe is where the line through the last two probes meets
    the budget, kept strictly between the longest T known to fit and the shortest known not to."""
    probes, fit, over = [], 0, LONGEST + unit
    T = unit
    while over - fit > unit:
        probes.append((T, footprint(T)))
        fit, over = (T, over) if probes[-1][1] <= budget else (fit, T)
        if len(probes) == 1:
            T = 2 * unit
        else:
            (t0, f0), (t1, f1) = probes[-2:]
            guess = t1 + (budget - f1) * (t1 - t0) / (f1 - f0) if f1 != f0 else 2 * t1
            T = min(max(int(guess) // unit * unit, fit + unit), over - unit)
    return fit


def exchange_row(split: Setup, T: int) -> dict:
    """The collectives of the split step at T by kind (module docstring), and the analytic exchange."""
    ops = collectives(split.compiled(T).as_text())
    layers = split.cfg.model.num_layers
    states = split.exchanged(T)
    analytic = sum(b for _, _, b in states)
    kib = lambda b: round(b / 1024, 2)
    return {"kind": split.kind, "exchanged (per device)": " ".join(sorted({f"{w} {s}" for w, s, _ in states})) or "-",
            "exchange KiB/layer": kib(sum(b for op, b, inside in ops if inside and op != "all-reduce") / layers),
            "analytic KiB/layer": kib(analytic / layers),
            "other KiB/layer": kib(sum(b for op, b, inside in ops if not inside and op != "all-reduce") / layers),
            "all-reduce KiB/step": kib(sum(b for op, b, _ in ops if op == "all-reduce"))}


def memory_row(one: Setup, split: Setup, T: int) -> dict:
    """memory_analysis of the step at T on one device and on the context axis."""
    a, b = one.compiled(T).memory_analysis(), split.compiled(T).memory_analysis()
    mib = lambda x: round(x / 2 ** 20, 2)
    return {"kind": one.kind, "T": T, "temp MiB one": mib(a.temp_size_in_bytes),
            f"temp MiB context={N}": mib(b.temp_size_in_bytes),
            "temp one/split": round(a.temp_size_in_bytes / b.temp_size_in_bytes, 2),
            "args MiB one": mib(a.argument_size_in_bytes), f"args MiB context={N}": mib(b.argument_size_in_bytes),
            "outputs MiB one": mib(a.output_size_in_bytes), f"outputs MiB context={N}": mib(b.output_size_in_bytes)}


def longest_row(one: Setup, split: Setup, budget_mb: float) -> dict:
    """The longest T within the budget on one device and on the context axis."""
    budget = int(budget_mb * 2 ** 20)
    unit = N * max(one.chunk, split.chunk)
    t1, tn = (longest(s.footprint, unit, budget) for s in (one, split))
    return {"kind": one.kind, "budget MiB": budget_mb, "unit": unit, "longest T one": t1,
            f"longest T context={N}": tn, "ratio": round(tn / t1, 2) if t1 else "-"}


def timed(setup: Setup, T: int, steps: int) -> float:
    """Median seconds of `steps` executed training steps at T (after one that compiles), random tokens."""
    rng = np.random.default_rng(0)
    shape, vocab = (1, setup.args.batch, T), setup.cfg.model.vocab_size
    sharding = batch_sharding(setup.mesh, 3, axis=1, time=True)
    batch = {"x": rng.integers(0, vocab, shape, np.int32), "y": rng.integers(0, vocab, shape, np.int32),
             "mask": np.ones(shape, np.float32)}
    params, rest, opt_state = jax.tree.map(jnp.copy, (setup.params, setup.rest, setup.opt_state))  # donated
    times = []
    with jax.set_mesh(setup.mesh):
        batch = jax.device_put(batch, sharding)
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            params, rest, opt_state, m = setup.step(params, rest, opt_state, batch)
            as_numpy(m["loss"])
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=None, choices=list(MIXERS),
                   help="mixer kinds (default: every kind whose layer has a context-parallel form)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens a row for the exchange, memory and time tables")
    p.add_argument("--batch", type=int, default=1, help="rows a step")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--budget-mb", type=float, default=256, help="memory per device of the longest-sequence search")
    p.add_argument("--search", nargs="*", default=["gla"], help="kinds of the search (`all`: every kind)")
    p.add_argument("--time", nargs="*", default=["gla"], help="kinds whose steps are timed")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    kinds = args.kinds or supported()
    search = kinds if args.search == ["all"] else [k for k in args.search if k in kinds]
    out = {"exchange": [], "memory": [], "longest": [], "time": []}
    for kind in kinds:
        t0 = time.perf_counter()
        one, split = Setup(kind, args, 1), Setup(kind, args, N)
        out["exchange"].append(exchange_row(split, args.seq_len))
        out["memory"].append(memory_row(one, split, args.seq_len))
        if kind in search:
            out["longest"].append(longest_row(one, split, args.budget_mb))
        if kind in args.time:
            t1, tn = timed(one, args.seq_len, args.steps), timed(split, args.seq_len, args.steps)
            out["time"].append({"kind": kind, "T": args.seq_len, "ms/step one": round(1e3 * t1, 1),
                                f"ms/step context={N}": round(1e3 * tn, 1), "ratio": round(tn / t1, 2)})
        print(f"{kind}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{jax.devices()[0].device_kind}, {N} simulated devices, jax {jax.__version__}; d_model {args.d_model}, "
          f"{args.layers} layers, batch {args.batch}, T {args.seq_len}")
    for name, rows in out.items():
        if rows:
            print()
            print_table(rows, list(rows[0]))
            save_json(f"context_{name}", rows)
    return out


if __name__ == "__main__":
    main()
