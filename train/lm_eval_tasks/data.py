"""The local tasks' loader: a JSONL file of this folder as the `test` split (lm-eval's custom_dataset, which
receives the task's dataset_kwargs and the run's metadata), so the tasks run from any folder with no network.
The files are lines of The Tempest, a validation play of the default corpus (train/corpus.py)."""

from pathlib import Path

import datasets


def load(file: str, **metadata):
    rows = datasets.load_dataset("json", data_files=str(Path(__file__).parent / file), split="train")
    return datasets.DatasetDict({"test": rows})
