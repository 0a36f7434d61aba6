"""Configs as dataclasses, the registry of kinds, and LanguageModel."""

from zoo import tokenizer
from zoo.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig, load_config
from zoo.model import LanguageModel
from zoo.registry import FFNS, MIXERS
