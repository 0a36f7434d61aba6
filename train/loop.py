"""One training loop for every architecture: data, optax, a jitted step, evaluation, orbax
checkpoints, metrics.

A run folder holds `config.yaml` (the resolved config), `metrics.jsonl` (one JSON object per logged
step), `checkpoints/<step>/` and `loss.png` (when matplotlib is installed). Started again on the same
folder, a run resumes from its latest complete checkpoint: parameters, optimiser state and step. The
data position and every random draw are functions of (seed, step), so nothing else needs saving and
the resumed run is bitwise the run that was never stopped (on the same machine). SIGTERM and Ctrl-C
write a checkpoint before exiting. What a resume accepts and refuses (a changed config, an unreadable
step, a torn metrics line) is train/resume.py's and zoo/checkpoint.py's.

On several devices (`train.mesh`, zoo/sharding.py) the same loop runs under `jax.set_mesh`: the
model is built by one jit whose outputs carry the parameters' NamedShardings, the optimiser state
follows its parameters, each batch is split by rows over the batch axes, and XLA partitions the
step. With several processes (hosts), each reads only the rows its devices hold, and only process 0
writes the config, metrics and plot (orbax writes every process's shards of a checkpoint).
"""

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import infer
from train import optim
from train.data import Batches, cache_dir, process_rows
from train.exits import fit_exit_classifiers
from train.prepare import bits_per_byte, prepare
from train.resume import check_run_dir, differences, metrics_upto
from train.tasks import TaskBatches
from zoo import checkpoint
from zoo.checkpoint import manager, prune, restore_latest
from zoo.config import Config, to_dict
from zoo.model import LanguageModel
from zoo.sharding import as_numpy, batch_sharding, describe, init_on_mesh, make_mesh, shardings_like_params


def _forward(graphdef, params, rest, batch, train: bool):
    """One batch: (sum of token losses, counted tokens, correctly predicted tokens (argmax), aux loss,
    layer metrics, new rest).

    Early exits add their weighted mean losses to `aux` and report them as `exit<l>_loss`.

    Layers report training-time losses and metrics by sowing nnx.Intermediate values (MoE: its
    balance and z losses, loads, drops); `aux_loss` entries are added to the loss. Non-parameter
    state that a layer updates in training (MoE's balancing bias) comes back as the new `rest`."""
    model = nnx.merge(graphdef, params, rest, copy=True)  # copy: layers may write state under grad
    model.train() if train else model.eval()
    logits, hidden = model(batch["x"], segment_ids=batch.get("segment_ids"), return_exits=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    sown = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))
    layer_metrics = {}
    for path, value in jax.tree_util.tree_leaves_with_path(sown):  # .../<sow name>/<call>/<metric>
        names = [p.key for p in path if isinstance(getattr(p, "key", None), str)]
        layer_metrics.setdefault(f"{names[-2]}_{names[-1]}", []).append(value)
    layer_metrics = {k: jnp.stack(v) for k, v in layer_metrics.items()}  # (layers, ...)
    aux = sum((jnp.sum(v) for k, v in layer_metrics.items() if k.endswith("_aux_loss")), jnp.float32(0))
    for j, (h, w) in enumerate(zip(hidden, model.cfg.exits.weights if hidden else ())):  # early exits
        exit_ce = optax.softmax_cross_entropy_with_integer_labels(model.exit_logits(j, h), batch["y"])
        layer_metrics[f"exit{model.exit_layers[j]}_loss"] = jnp.sum(exit_ce * batch["mask"]) / jnp.sum(batch["mask"])
        aux = aux + w * layer_metrics[f"exit{model.exit_layers[j]}_loss"]
    new_rest = nnx.state(model, nnx.Not(nnx.Param))
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["y"]) * batch["mask"])
    return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]), correct, aux, layer_metrics, new_rest


def make_train_step(graphdef, tx, out_shardings=None):
    """step(params, rest, opt_state, batch) with batch leaves shaped (micro_batches, b, T).
    `out_shardings` (params, rest, opt_state, metrics) keeps a sharded state where it was.

    Gradients of the summed token loss (plus each micro-batch's aux loss weighted by its tokens) are
    accumulated over micro-batches and divided by the total token count once, so k micro-batches
    give the gradient of one batch k times larger. `rest` (e.g. MoE biases) updates per micro-batch."""
    def step(params, rest, opt_state, batch):
        def objective(p, r, b):
            loss_sum, count, _, aux, layer_metrics, r = _forward(graphdef, p, r, b, train=True)
            return loss_sum + aux * count, (loss_sum, count, layer_metrics, r)

        def micro(acc, b):
            loss_sum, count, layer_metrics, grads, r = acc
            (_, (ls, n, lm, r)), g = jax.value_and_grad(objective, has_aux=True)(params, r, b)
            lm = jax.tree.map(jnp.add, layer_metrics, lm)
            return (loss_sum + ls, count + n, lm, jax.tree.map(jnp.add, grads, g), r), None

        k = jax.tree.leaves(batch)[0].shape[0]
        shapes = jax.eval_shape(lambda: _forward(graphdef, params, rest, jax.tree.map(lambda x: x[0], batch), True))
        zeros = (jnp.float32(0), jnp.float32(0), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[4]),
                 jax.tree.map(jnp.zeros_like, params), rest)
        (loss_sum, count, layer_metrics, grads, rest), _ = jax.lax.scan(micro, zeros, batch)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        loss, grad_norm = loss_sum / count, optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
                   "layers": jax.tree.map(lambda x: x / k, layer_metrics)}
        return optax.apply_updates(params, updates), rest, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 2), out_shardings=out_shardings)


def init_state(cfg: Config, tx, mesh: Mesh):
    """(graphdef, params, rest, opt_state, shardings) of a new run with optimiser `tx` on `mesh`.
    The model and the optimiser state are made inside jit with the parameters' shardings as outputs, so
    no device ever holds more than its shards; `shardings` = NamedShardings of (params, rest,
    opt_state)."""
    graphdef, params, rest, (param_sh, rest_sh) = init_on_mesh(
        lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), mesh)
    opt_sh = shardings_like_params(jax.eval_shape(tx.init, params), param_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    return graphdef, params, rest, opt_state, (param_sh, rest_sh, opt_sh)


def batch_placer(cfg: Config, mesh: Mesh):
    """(train_batch(batches, step), val_batch(batches, i)): global arrays of the step's batch as
    (micro_batches, b, T), rows split over the batch axes, of which this process reads only its own."""
    t = cfg.train
    k, micro = t.grad_accum, t.batch_size // t.grad_accum
    split = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
    if micro % split:
        raise ValueError(f"train.batch_size: {t.batch_size} rows (train.grad_accum={k} micro-batches of {micro}) "
                         f"do not split over the batch axes of train.mesh ({describe(mesh)}: data x fsdp x expert "
                         f"= {split} devices); use a micro-batch that is a multiple of {split}")
    train_sh, val_sh = batch_sharding(mesh, 3, axis=1), batch_sharding(mesh, 2)
    local = process_rows(train_sh, (k, micro, t.seq_len), axis=1)
    rows = (np.arange(k)[:, None] * micro + local).reshape(-1)  # this process's rows of the whole batch
    val_rows = process_rows(val_sh, (t.batch_size, t.seq_len), axis=0)

    def train_batch(batches: Batches | TaskBatches, step: int) -> dict:
        b = batches.train_batch(step, t.batch_size, rows=rows)
        return {n: jax.make_array_from_process_local_data(train_sh, v.reshape(k, len(local), t.seq_len),
                                                          (k, micro, t.seq_len)) for n, v in b.items()}

    def val_batch(batches: Batches | TaskBatches, i: int) -> dict:
        b = batches.val_batch(i, t.batch_size, rows=val_rows)
        return {n: jax.make_array_from_process_local_data(val_sh, v, (t.batch_size, t.seq_len)) for n, v in b.items()}

    return train_batch, val_batch


def _layer_metrics(layers: dict) -> dict:
    """Per-step metrics that layers sowed, for metrics.jsonl: scalars averaged over layers (MoE:
    aux/balance/z losses, dropped fraction, router entropy), vectors kept per layer (tokens per expert)."""
    return {name: np.asarray(v).tolist() if np.ndim(v) > 1 else round(float(np.mean(v)), 6)
            for name, v in layers.items()}


def redraw_features(graphdef, params, rest, key):
    """New random features in every layer that has them (Performer); returns the new `rest`."""
    model = nnx.merge(graphdef, params, rest, copy=True)  # leave the caller's `rest` untouched
    found = [m for _, m in nnx.iter_modules(model) if getattr(m, "feature_map", None) == "performer"]
    for i, m in enumerate(found):
        m.redraw_features(jax.random.fold_in(key, i))
    return nnx.split(model, nnx.Param, ...)[2]


def plot(run_dir: Path):
    """loss.png: train and validation loss against tokens; skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] for r in rows], [r["loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="tokens", ylabel="loss (nats/token)", title=run_dir.name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)


def _progress_bar(steps: int, start: int):
    """A rich progress bar (step, loss, lr, tokens/s) when stdout is a terminal; None otherwise."""
    if not sys.stdout.isatty():
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[status]}"))
    bar.add_task("train", total=steps, completed=start, status="")
    return bar


class _Signals:
    """Turns SIGTERM / SIGINT into a flag the loop checks after each step."""

    def __init__(self):
        self.received = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def use_compilation_cache():
    """JAX's persistent compilation cache under $ZOO_CACHE/xla: a second run of the same config (or a
    resume) loads its compiled step instead of compiling it again. Programs that compile in under a
    second are not worth the disk and stay out (JAX's default threshold)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def run(cfg: Config, run_dir, *, log=print, mesh: Mesh | None = None, allow_config_change: bool = False) -> dict:
    """Train `cfg` in `run_dir` (resuming if it holds a checkpoint) on `mesh` (default: train.mesh
    over every device); returns the last metrics. A run folder written with another config is
    refused unless `allow_config_change` (train/resume.py). Exits with 128 + signal number after a
    SIGTERM / SIGINT checkpoint, 1 on a non-finite loss."""
    use_compilation_cache()
    mesh = make_mesh(cfg.train.mesh) if mesh is None else mesh
    with jax.set_mesh(mesh):
        return _run(cfg, Path(run_dir), mesh, log, allow_config_change)


def _run(cfg: Config, run_dir: Path, mesh: Mesh, log, allow_config_change: bool) -> dict:
    started, t = time.perf_counter(), cfg.train
    primary = jax.process_index() == 0  # the one process that writes files and prints
    if not primary:
        log = lambda *_: None  # noqa: E731
    train_batch, val_batch = batch_placer(cfg, mesh)
    commit = check_run_dir(run_dir, cfg, allow_config_change, log)
    task = cfg.data.task
    corpus = None if task else prepare(cfg.data, log)  # tokenised into shards once, then read from the cache
    batches = TaskBatches(task, t.seq_len, t.seed) if task else corpus.batches(t.seq_len, t.seed, cfg.data.packing)
    tokenizer = None if task else corpus.tokenizer()
    if primary:
        commit()
        if corpus and (corpus.folder / "tokenizer.json").is_file():  # python -m infer reads it from the run folder
            shutil.copyfile(corpus.folder / "tokenizer.json", run_dir / "tokenizer.json")

    tx = optim.optimizer(t)
    graphdef, params, rest, opt_state, (param_sh, rest_sh, opt_sh) = init_state(cfg, tx, mesh)
    lr_at = optim.schedule(t)
    mngr = manager(run_dir / "checkpoints")
    targets = {"params": nnx.to_pure_dict(params), "rest": nnx.to_pure_dict(rest), "opt_state": opt_state, "meta": {}}
    if not jax.tree.leaves(targets["rest"]):  # orbax refuses empty items
        del targets["rest"]

    def mismatch(meta, error):
        changed = differences(meta.get("config") or {}, to_dict(cfg))
        raise ValueError(f"train.run_dir: the checkpoints in {run_dir} are intact but do not fit this config's "
                         f"model or optimiser state ({'; '.join(f'{k}: {a!r} there, {b!r} now' for k, a, b in changed)}"
                         f"); this change cannot be resumed: give another train.run_dir") from error

    start, restored = restore_latest(mngr, targets, mismatch)
    skipped = 0
    if start is not None:
        nnx.replace_by_pure_dict(params, restored["params"])
        if "rest" in targets:
            nnx.replace_by_pure_dict(rest, restored["rest"])
        opt_state, skipped = restored["opt_state"], restored["meta"].get("skipped", 0)
        log(f"resumed from {run_dir}/checkpoints/{start}")
        prune(mngr, t.keep_checkpoints)
    elif cfg.model.init_from is not None:
        from zoo.hf import read_params
        params = read_params(cfg.model.init_from, cfg.model, params, param_sh)
        log(f"starting from the weights of {cfg.model.init_from}")
    start = start or 0
    metrics_path = run_dir / "metrics.jsonl"
    kept = metrics_upto(metrics_path, start, log)
    if primary:
        metrics_path.write_text("".join(line + "\n" for line in kept))
    end = json.loads(kept[-1]) if start > 0 and kept else {}
    stop = t.stop_at_accuracy
    stopped = end.get("stopped_early") and stop is not None and end["val_accuracy"] >= stop
    if start >= t.steps or stopped:
        why = (f"step {start}'s accuracy reached train.stop_at_accuracy={stop}" if stopped
               else f"its checkpoint is step {start} of train.steps={t.steps}")
        log(f"{run_dir} is finished: {why}; nothing to train (to train on, raise train.steps"
            f"{' or train.stop_at_accuracy' if stopped else ''} and pass --allow-config-change)")
        mngr.close()
        return end

    replicated = NamedSharding(mesh, PartitionSpec())
    step_fn = make_train_step(graphdef, tx, (param_sh, rest_sh, opt_sh, replicated))
    eval_fn = jax.jit(lambda p, r, b: _forward(graphdef, p, r, b, train=False)[:3], out_shardings=replicated)

    def save(step):
        items = {"params": nnx.to_pure_dict(params), "opt_state": opt_state}
        if "rest" in targets:
            items["rest"] = nnx.to_pure_dict(rest)
        checkpoint.save(mngr, step, items, {"step": step, "skipped": skipped, "config": to_dict(cfg)})
        prune(mngr, t.keep_checkpoints)

    def evaluate():
        n = batches.num_val_batches(t.batch_size) if task else t.eval_batches  # a task: its whole test set
        sums = np.sum([jax.tree.map(as_numpy, eval_fn(params, rest, val_batch(batches, i))) for i in range(n)], axis=0)
        loss = float(sums[0] / sums[1])
        out = {"val_loss": loss, "val_accuracy": float(sums[2] / sums[1])} if task else \
            {"val_loss": loss, "val_bpb": bits_per_byte(loss, corpus)}
        if t.sample_tokens and not task:
            model = nnx.merge(graphdef, params, rest)
            out["sample"] = infer.generate_text(model, ["\n"], max_new_tokens=t.sample_tokens, tokenizer=tokenizer,
                                                sampling=infer.Sampling(0.8, top_k=40), seed=t.seed)[0]
        return out

    last, step_time, eval_time, wall0 = {}, 0.0, 0.0, time.perf_counter()
    window_start, window_tokens = wall0, 0
    bar = _progress_bar(t.steps, start) if log is print else None
    unit = "byte" if cfg.data.tokenizer.kind == "bytes" else "token"
    if bar:
        log = bar.console.print
    metrics_out = metrics_path.open("a") if primary else open(os.devnull, "w")
    with bar or contextlib.nullcontext(), _Signals() as signals, metrics_out as metrics_file:
        for step in range(start + 1, t.steps + 1):
            batch = train_batch(batches, step)
            t0 = time.perf_counter()
            params, rest, opt_state, m = step_fn(params, rest, opt_state, batch)
            m = jax.tree.map(as_numpy, m)  # waits for the step
            finite = bool(m["finite"])
            step_time += time.perf_counter() - t0
            if step == start + 1:
                log(f"first step done {time.perf_counter() - started:.1f} s after the start, compiles included "
                    f"(compiled programs are kept in {jax.config.jax_compilation_cache_dir}: a second run loads them)")
            window_tokens += t.batch_size * t.seq_len
            if bar:
                bar.update(0, completed=step)
            if t.redraw_features_every and step % t.redraw_features_every == 0:  # a function of (seed, step)
                rest = jax.device_put(redraw_features(graphdef, params, rest,
                                                      jax.random.fold_in(jax.random.key(t.seed), step)), rest_sh)
            if not finite:
                if t.on_nonfinite == "stop":
                    mngr.wait_until_finished()
                    log(f"step {step}: non-finite loss or gradient (loss={float(m['loss'])}); stopping. "
                        f"The last good checkpoint is step {mngr.latest_step()} in {run_dir}/checkpoints")
                    sys.exit(1)
                skipped += 1
            final = step == t.steps
            if step % t.log_every == 0 or step % t.eval_every == 0 or final:
                now = time.perf_counter()
                last = {"step": step, "tokens": step * t.batch_size * t.seq_len, "loss": float(m["loss"]),
                        "lr": float(lr_at(step - 1)), "grad_norm": float(m["grad_norm"]),
                        "tokens_per_s": round(window_tokens / (now - window_start), 1), "skipped": skipped}
                last.update(_layer_metrics(m["layers"]))
                if step % t.eval_every == 0 or final:
                    e0 = time.perf_counter()
                    last.update(evaluate())
                    eval_time += time.perf_counter() - e0
                    if t.stop_at_accuracy is not None and last["val_accuracy"] >= t.stop_at_accuracy and not final:
                        last["stopped_early"] = final = True
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                val = (f"  val {last['val_loss']:.4f} nats/{unit} ({last['val_bpb']:.3f} bpb)" if "val_bpb" in last
                       else f"  val {last['val_loss']:.4f}  accuracy {last['val_accuracy']:.4f}" if "val_loss" in last
                       else "")
                log(f"step {step:>6}/{t.steps}  loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
                    f"{last['tokens_per_s']:,.0f} tok/s" + val)
                if "sample" in last:
                    log("  sample: " + last["sample"].replace("\n", "\n  "))
                if bar:
                    bar.update(0, status=f"loss {last['loss']:.4f}  lr {last['lr']:.2e}  "
                                        f"{last['tokens_per_s']:,.0f} tok/s")
                window_start, window_tokens = time.perf_counter(), 0
            fit_steps = cfg.model.exits.classifier_steps if cfg.model.exits else 0
            if final and fit_steps:  # on the frozen model, before the last checkpoint
                model = nnx.merge(graphdef, params, rest)
                losses = fit_exit_classifiers(  # whole batches as (B, T), rows still split over the mesh
                    model, lambda i: {n: v.reshape(t.batch_size, t.seq_len)
                                      for n, v in train_batch(batches, step + 1 + i).items()}, steps=fit_steps)
                params = nnx.state(model, nnx.Param)
                log(f"exit classifiers: binary cross-entropy {losses[0]:.4f} -> {losses[-1]:.4f} "
                    f"in {fit_steps} steps")
            if step % t.checkpoint_every == 0 or final or signals.received:
                save(step)
            if signals.received:
                mngr.wait_until_finished()
                log(f"received signal {signals.received}: checkpoint of step {step} written to {run_dir}")
                sys.exit(128 + signals.received)
            if final:
                break
    mngr.wait_until_finished()
    mngr.close()
    if last:
        wall = time.perf_counter() - wall0
        last["overhead"] = 1 - step_time / max(wall - eval_time, 1e-9)
        log(f"done: {last['step']} steps{' (stop_at_accuracy reached)' if last.get('stopped_early') else ''}; "
            f"{last['overhead']:.1%} of training time outside the jitted step "
            f"(data, logging, checkpoints; evaluation excluded)")
        if primary:
            plot(run_dir)
    return last


def default_run_dir(cfg: Config, config_path) -> Path:
    return Path(cfg.train.run_dir) if cfg.train.run_dir else Path("runs") / Path(config_path).stem
