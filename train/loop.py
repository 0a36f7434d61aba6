"""One training loop for every architecture: data, optax, a jitted step, evaluation, orbax
checkpoints, metrics.

A run folder holds `config.yaml` (the resolved config), `metrics.jsonl` (one JSON object per logged
step), `checkpoints/<step>/` and `loss.png` (when matplotlib is installed). Started again on the same
folder, a run resumes from its latest complete checkpoint: parameters, optimiser state and step. The
data position and every random draw are functions of (seed, step), so nothing else needs saving and
the resumed run is bitwise the run that was never stopped (on the same machine). SIGTERM and Ctrl-C
write a checkpoint before exiting. What a resume accepts and refuses (a changed config, an unreadable
step, a torn metrics line) is train/resume.py's and zoo/checkpoint.py's.

`run` reads as its steps: set up (`_set_up`: the run folder and the data), initialise or restore
(`_init_or_restore`, `Checkpoints`), then per step `_train_step`, `_evaluate` every
train.eval_every steps, the metrics row (train/report.py) and `Checkpoints.save`. The jitted
computations are train/step.py's. Experiments that drive training (train/sweep.py and the rest)
call `run` and read the run folder it writes; the loop knows none of them.

On several devices (`train.mesh`) the same loop runs under `jax.set_mesh`, with everything about the
mesh in zoo/sharding.py: the model is built by one jit whose outputs carry the parameters'
NamedShardings, the optimiser state follows its parameters, each batch is split by rows over the
batch axes, and XLA partitions the step. With several processes (hosts), each reads only the rows
its devices hold, and only process 0 writes the config, metrics and plot (orbax writes every
process's shards of a checkpoint).
"""

import dataclasses
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import infer
from train import optim
from train.convert import initialise
from train.data import cache_dir
from train.distill import load_teacher, start_from
from train.exits import fit_exit_classifiers
from train.lora import adapt
from train.prepare import Prepared, bits_per_byte, prepare
from train.report import Report
from train.resume import check_run_dir, differences
from train.step import make_eval_step, make_train_step, redraw_features
from train.tasks import TaskBatches
from zoo import checkpoint
from zoo.config import Config, to_dict
from zoo.sharding import as_numpy, batch_placer, init_optimizer, init_state, make_mesh


@dataclasses.dataclass
class State:
    """What training changes: the parameters, the other model state (MoE biases, Performer
    features), the optimiser state and the count of steps skipped for a non-finite loss; with the
    graphdef, the optimiser and the NamedShardings of (params, rest, opt_state), which keep them
    where they were made."""
    graphdef: Any
    tx: optax.GradientTransformation
    params: Any  # nnx.State
    rest: Any  # nnx.State
    opt_state: Any
    shardings: tuple
    skipped: int = 0

    def model(self):
        """The model these parameters make (for samples and the exit classifiers)."""
        return nnx.merge(self.graphdef, self.params, self.rest)


@dataclasses.dataclass
class Data:
    """The run's batches, placed on the mesh (zoo.sharding.batch_placer), and what evaluation reads
    beside them: a text run's corpus (bits per byte) and tokenizer (samples); None for a task."""
    source: Any  # train.data.Batches or train.tasks.TaskBatches
    corpus: Prepared | None
    tokenizer: Any
    placers: tuple

    def train(self, step: int) -> dict:
        """The batch of `step`: (micro_batches, b, T) global arrays."""
        return self.placers[0](self.source, step)

    def val(self, i: int) -> dict:
        """The i-th validation batch: (B, T) global arrays."""
        return self.placers[1](self.source, i)


class Checkpoints:
    """The run's orbax checkpoints (zoo/checkpoint.py): the newest intact step restored into a State,
    a State saved with its step, no more than train.keep_checkpoints kept."""

    def __init__(self, cfg: Config, run_dir: Path, state: State):
        self.cfg, self.run_dir = cfg, run_dir
        self.mngr = checkpoint.manager(run_dir / "checkpoints")
        self.has_rest = bool(jax.tree.leaves(nnx.to_pure_dict(state.rest)))  # orbax refuses empty items

    def _items(self, state: State) -> tuple[dict, list[dict]]:
        """(the items to save, where train.lora's adapters go: zoo.checkpoint.split_adapters)."""
        params, adapters, where = checkpoint.split_adapters(nnx.to_pure_dict(state.params))
        items = {"params": params, "opt_state": state.opt_state}
        if self.has_rest:
            items["rest"] = nnx.to_pure_dict(state.rest)
        if adapters:
            items["adapters"] = adapters
        return items, where

    def _mismatch(self, meta: dict, error: Exception):
        changed = differences(meta.get("config") or {}, to_dict(self.cfg))
        raise ValueError(f"train.run_dir: the checkpoints in {self.run_dir} are intact but do not fit this config's "
                         f"model or optimiser state ({'; '.join(f'{k}: {a!r} there, {b!r} now' for k, a, b in changed)}"
                         f"); this change cannot be resumed: give another train.run_dir") from error

    def restore(self, state: State, log) -> int:
        """Restore the newest intact step into `state`; its step (0 when there is none)."""
        items, where = self._items(state)
        step, restored = checkpoint.restore_latest(self.mngr, items | {"meta": {}}, self._mismatch)
        if step is None:
            return 0
        if where:
            checkpoint.join_adapters(restored["params"], restored["adapters"], where, self.cfg.train.lora.scale)
        nnx.replace_by_pure_dict(state.params, restored["params"])
        if self.has_rest:
            nnx.replace_by_pure_dict(state.rest, restored["rest"])
        state.opt_state, state.skipped = restored["opt_state"], restored["meta"].get("skipped", 0)
        log(f"resumed from {self.run_dir}/checkpoints/{step}")
        checkpoint.prune(self.mngr, self.cfg.train.keep_checkpoints)
        return step

    def save(self, step: int, state: State):
        items, where = self._items(state)
        meta = {"step": step, "skipped": state.skipped, "config": to_dict(self.cfg)}
        if where:
            meta["adapters"] = where
        checkpoint.save(self.mngr, step, items, meta)
        checkpoint.prune(self.mngr, self.cfg.train.keep_checkpoints)

    def latest(self) -> int | None:
        """The newest step on disk, once every write has finished."""
        self.mngr.wait_until_finished()
        return self.mngr.latest_step()

    def close(self):
        self.mngr.wait_until_finished()
        self.mngr.close()


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
    resume) loads its compiled programs instead of compiling them again. Every program, however quick
    to compile: the initialisers' small ones add up (24 of about 0.1 s each for a 4-layer Transformer),
    and with them kept configs/transformer.yaml's first step comes 2.0-2.2 s after the start instead of 3.8
    (the step and evaluation alone cached; 6.4 s with nothing cached; 2-core EPYC, 2026-12-07)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def run(cfg: Config, run_dir, *, log=print, mesh: Mesh | None = None, allow_config_change: bool = False) -> dict:
    """Train `cfg` in `run_dir` (resuming if it holds a checkpoint) on `mesh` (default: train.mesh
    over every device); returns the last metrics. A run folder written with another config is
    refused unless `allow_config_change` (train/resume.py). Exits with 128 + signal number after a
    SIGTERM / SIGINT checkpoint, 1 on a non-finite loss."""
    started = time.perf_counter()
    use_compilation_cache()
    mesh = make_mesh(cfg.train.mesh) if mesh is None else mesh
    run_dir, primary = Path(run_dir), jax.process_index() == 0  # the one process that writes files and prints
    report = Report(cfg, run_dir, log, primary, started)
    with jax.set_mesh(mesh):
        data = _set_up(cfg, run_dir, mesh, report.log, allow_config_change, primary)
        teacher = load_teacher(cfg, mesh, data.tokenizer) if cfg.train.distill else None  # checked before work
        state, checkpoints, start = _init_or_restore(cfg, run_dir, mesh, report.log, teacher)
        end = report.resume(start)
        if _finished(cfg, run_dir, start, end, report.log):
            checkpoints.close()
            return end
        return _train(cfg, mesh, data, state, checkpoints, report, start, teacher)


def _set_up(cfg: Config, run_dir: Path, mesh: Mesh, log, allow_config_change: bool, primary: bool) -> Data:
    """Check the batch split and the run folder (before any work), read the data, then (process 0)
    write config.yaml and the tokenizer, which `python -m infer` reads from the run folder."""
    t, task = cfg.train, cfg.data.task
    placers = batch_placer(cfg, mesh)
    commit = check_run_dir(run_dir, cfg, allow_config_change, log)
    corpus = None if task else prepare(cfg.data, log)  # tokenised into shards once, then read from the cache
    source = TaskBatches(task, t.seq_len, t.seed) if task else corpus.batches(t.seq_len, t.seed, cfg.data.packing)
    data = Data(source, corpus, None if task else corpus.tokenizer(), placers)
    if primary:
        commit()
        if corpus and (corpus.folder / "tokenizer.json").is_file():
            shutil.copyfile(corpus.folder / "tokenizer.json", run_dir / "tokenizer.json")
    return data


def _init_or_restore(cfg: Config, run_dir: Path, mesh: Mesh, log, teacher: tuple | None
                     ) -> tuple[State, Checkpoints, int]:
    """(state, checkpoints, step): the State of the run's newest intact checkpoint and its step, or
    a new State (from model.init_from's weights where given, or the `teacher`'s for a student that
    train.distill.convert makes) and step 0. With train.lora the adapters go onto the starting
    weights before the checkpoint is read, since it holds them (train/lora.py)."""
    tx = optim.optimizer(cfg.train, cfg.model.num_layers)
    graphdef, params, rest, opt_state, shardings = init_state(cfg, tx, mesh)
    state = State(graphdef, tx, params, rest, opt_state, shardings)
    lora, said = cfg.train.lora, []
    if lora is not None:
        said = _start_weights(cfg, state, mesh, teacher)
        state.graphdef, state.params, param_sh = adapt(graphdef, state.params, rest, lora, cfg.train.seed, mesh)
        state.opt_state, opt_sh = init_optimizer(tx, state.params, param_sh, mesh)
        state.shardings = (param_sh, shardings[1], opt_sh)
    checkpoints = Checkpoints(cfg, run_dir, state)
    start = checkpoints.restore(state, log)
    if not start and lora is None:
        said = _start_weights(cfg, state, mesh, teacher)
    for line in said if not start else []:
        log(line)
    return state, checkpoints, start


def _start_weights(cfg: Config, state: State, mesh: Mesh, teacher: tuple | None) -> list[str]:
    """Put a new run's starting weights into `state`: model.init_from's, then train.distill.start_from's
    or the teacher's through train.distill.convert; the lines that say which (none: fresh weights)."""
    distill, shardings, said = cfg.train.distill, state.shardings[0], []
    if cfg.model.init_from is not None:
        from zoo.hf import read_params
        both = read_params(cfg.model.init_from, cfg.model, nnx.merge_state(state.params, state.rest),
                           nnx.merge_state(shardings, state.shardings[1]))  # the rest: an MoE's router bias
        state.params, state.rest = both.filter(nnx.Param), both.filter(nnx.Not(nnx.Param))
        said.append(f"starting from the weights of {cfg.model.init_from}")
    if distill is not None and distill.start_from is not None:
        state.params = start_from(distill.start_from, cfg, mesh, shardings)
        said.append(f"starting from the weights of {distill.start_from}")
    elif distill is not None and distill.convert is not None:
        state.params, mapped = initialise(state.params, teacher[1], cfg.model, shardings)
        said.append(f"starting from {distill.teacher}: {len(mapped)} of {len(jax.tree.leaves(state.params))} "
                    "parameters taken from the teacher (train/convert.py)")
    return said


def _finished(cfg: Config, run_dir: Path, start: int, end: dict, log) -> bool:
    """Whether the run folder holds a finished run (all its steps, or stopped at its accuracy)."""
    t = cfg.train
    stop = t.stop_at_accuracy
    stopped = end.get("stopped_early") and stop is not None and end["val_accuracy"] >= stop
    if start < t.steps and not stopped:
        return False
    why = (f"step {start}'s accuracy reached train.stop_at_accuracy={stop}" if stopped
           else f"its checkpoint is step {start} of train.steps={t.steps}")
    log(f"{run_dir} is finished: {why}; nothing to train (to train on, raise train.steps"
        f"{' or train.stop_at_accuracy' if stopped else ''} and pass --allow-config-change)")
    return True


def _train(cfg: Config, mesh: Mesh, data: Data, state: State, checkpoints: Checkpoints, report: Report,
           start: int, teacher: tuple | None) -> dict:
    """Steps start + 1 .. train.steps (or until train.stop_at_accuracy); the last metrics row. A
    `teacher` (graphdef, params, rest) is distilled (train.distill)."""
    t, last = cfg.train, {}
    replicated = NamedSharding(mesh, PartitionSpec())
    step_fn = make_train_step(state.graphdef, state.tx, (*state.shardings, replicated), teacher, t.distill, t.qat)
    eval_fn = make_eval_step(state.graphdef, replicated, t.qat)
    report.measure_utilisation(state.model())
    with report, _Signals() as signals:
        for step in range(start + 1, t.steps + 1):
            m = _train_step(cfg, state, step_fn, data, step, report)
            if not bool(m["finite"]):
                _non_finite(cfg, state, m, step, checkpoints, report.log)
            final = step == t.steps
            if step % t.log_every == 0 or step % t.eval_every == 0 or final:
                last = report.row(step, m, state.skipped)
                if step % t.eval_every == 0 or final:
                    with report.evaluating():
                        last |= _evaluate(cfg, data, eval_fn, state)
                    if t.stop_at_accuracy is not None and last["val_accuracy"] >= t.stop_at_accuracy and not final:
                        last["stopped_early"] = final = True
                report.write(last)
            if final and cfg.model.exits and cfg.model.exits.classifier_steps:
                _fit_exits(cfg, state, data, step, report.log)  # on the frozen model, before the last checkpoint
            if step % t.checkpoint_every == 0 or final or signals.received:
                checkpoints.save(step, state)
            if signals.received:
                checkpoints.latest()  # waits for the write
                report.log(f"received signal {signals.received}: checkpoint of step {step} written to "
                           f"{checkpoints.run_dir}")
                sys.exit(128 + signals.received)
            if final:
                break
    checkpoints.close()
    if last:
        report.done(last)
    return last


def _train_step(cfg: Config, state: State, step_fn, data: Data, step: int, report: Report) -> dict:
    """One optimiser step on the batch of `step`, then the redraw of random features when due; its
    metrics as numpy."""
    t = cfg.train
    batch = data.train(step)
    t0 = time.perf_counter()
    state.params, state.rest, state.opt_state, m = step_fn(state.params, state.rest, state.opt_state, batch)
    m = jax.tree.map(as_numpy, m)  # waits for the step
    report.stepped(step, time.perf_counter() - t0)
    if t.redraw_features_every and step % t.redraw_features_every == 0:  # a function of (seed, step)
        key = jax.random.fold_in(jax.random.key(t.seed), step)
        state.rest = jax.device_put(redraw_features(state.graphdef, state.params, state.rest, key), state.shardings[1])
    return m


def _non_finite(cfg: Config, state: State, m: dict, step: int, checkpoints: Checkpoints, log):
    """A non-finite loss or gradient: stop the run (train.on_nonfinite=stop) or count the step as skipped."""
    if cfg.train.on_nonfinite == "stop":
        latest = checkpoints.latest()
        bad = [jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value")
               for p, ok in jax.tree_util.tree_flatten_with_path(m["finite_grads"])[0] if not ok]
        grads = f"; non-finite gradient of {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else ""
        log(f"step {step}: non-finite loss or gradient (loss={float(m['loss'])}{grads}); stopping. "
            f"The last good checkpoint is step {latest} in {checkpoints.run_dir}/checkpoints")
        sys.exit(1)
    state.skipped += 1


def _evaluate(cfg: Config, data: Data, eval_fn, state: State) -> dict:
    """Validation loss (and bits per byte, or a task's accuracy on its whole test set), with a
    sample of train.sample_tokens for a text run."""
    t, task = cfg.train, cfg.data.task
    n = data.source.num_val_batches(t.batch_size) if task else t.eval_batches
    sums = np.sum([jax.tree.map(as_numpy, eval_fn(state.params, state.rest, data.val(i))) for i in range(n)], axis=0)
    loss = float(sums[0] / sums[1])
    if task:
        return {"val_loss": loss, "val_accuracy": float(sums[2] / sums[1])}
    out = {"val_loss": loss, "val_bpb": bits_per_byte(loss, data.corpus)}
    if t.sample_tokens:
        out["sample"] = infer.generate_text(state.model(), ["\n"], max_new_tokens=t.sample_tokens,
                                            tokenizer=data.tokenizer, sampling=infer.Sampling(0.8, top_k=40),
                                            seed=t.seed)[0]
    return out


def _fit_exits(cfg: Config, state: State, data: Data, step: int, log):
    """Fit the early-exit classifiers (train/exits.py) on the batches after the last step."""
    t, fit_steps = cfg.train, cfg.model.exits.classifier_steps
    model = state.model()
    losses = fit_exit_classifiers(  # whole batches as (B, T), rows still split over the mesh
        model, lambda i: {n: v.reshape(t.batch_size, t.seq_len) for n, v in data.train(step + 1 + i).items()},
        steps=fit_steps)
    state.params = nnx.state(model, nnx.Param)
    log(f"exit classifiers: binary cross-entropy {losses[0]:.4f} -> {losses[-1]:.4f} in {fit_steps} steps")


def default_run_dir(cfg: Config, config_path) -> Path:
    return Path(cfg.train.run_dir) if cfg.train.run_dir else Path("runs") / Path(config_path).stem
