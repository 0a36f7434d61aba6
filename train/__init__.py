"""Pretraining: data, optimiser, loop, checkpoints, CLI (`python -m train CONFIG [key=value ...]`)."""

from train.loop import run
