"""Pretraining: data, optimiser, loop, checkpoints, CLI (`python -m train CONFIG [key=value ...]`).

The loop: loop.py (`run`: set up or restore, step, evaluate, log, checkpoint), step.py (the jitted
step and evaluation), report.py (metrics.jsonl, console, progress bar, loss.png), resume.py (what
a run folder accepts), optim.py. Its data: prepare.py and corpus.py (a tokenised corpus), data.py
(batches from it), tasks.py (synthetic tasks). The mesh and the placement of batches on it are
zoo/sharding.py's. Experiments beside the loop, each reaching it only through `run`, the run folder
it writes, or a checkpoint: sweep.py (grids of runs), calibrate.py (per-head sparse masks),
extrapolate.py (length extrapolation); exits.py fits the early-exit classifiers at the end of a run
whose model has them.
"""


def __getattr__(name):  # train.run, imported on first use: `python -m train.prepare` needs no training loop
    if name == "run":
        from train.loop import run
        return run
    raise AttributeError(f"module 'train' has no attribute {name!r}")
