"""Pretraining: data, optimiser, loop, checkpoints, CLI (`python -m train CONFIG [key=value ...]`)."""


def __getattr__(name):  # train.run, imported on first use: `python -m train.prepare` needs no training loop
    if name == "run":
        from train.loop import run
        return run
    raise AttributeError(f"module 'train' has no attribute {name!r}")
