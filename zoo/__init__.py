"""Configs as dataclasses, the registry of kinds, LanguageModel, and loading a trained run."""

from zoo import checkpoint, tokenizer
from zoo.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
from zoo.model import LanguageModel
from zoo.registry import FFNS, MIXERS
from zoo.run_file import load_config
