"""What a run folder holds, checked before a run starts on it: nothing finished is lost, nothing
changes silently.

- The folder must be a directory this process can write (or not exist yet).
- A run with checkpoints resumes only under the config it was written with (the one saved in its
  newest intact checkpoint; config.yaml for older runs). Keys that do not change what the run
  computes may differ freely and are printed (logging, evaluation and checkpoint cadence, samples,
  the mesh, a mixer's impl, mode and chunk size: every mode and impl computes the same function; the
  processes and shard size of the prepare step: the token streams are the same).
  Any other difference (the model, the data, the learning rate, the number of steps...) stops the
  run with an error naming each key, unless the user passes --allow-config-change; then the
  changes are printed, and config.yaml is rewritten with the previous one kept beside it.
- metrics.jsonl keeps the lines up to the resumed step; a torn last line (a kill mid-write) is
  dropped with a message.
"""

import json
import os
from pathlib import Path

import yaml

from zoo.checkpoint import manager, newest_meta
from zoo.config import Config, from_dict, to_dict

SAFE = ("train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
        "train.keep_checkpoints", "train.sample_tokens", "train.run_dir", "train.on_nonfinite", "train.mesh.",
        "data.workers", "data.shard_mb")  # how the corpus is tokenised, not into what
SAFE_SUFFIXES = (".impl", ".mode", ".chunk_size")


def _flat(data, prefix="") -> dict:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        return {k: v for i, value in enumerate(data) for k, v in _flat(value, f"{prefix[:-1]}[{i}].").items()}
    return {prefix[:-1]: data}


def differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every key whose value differs."""
    a, b = _flat(old), _flat(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _safe(key: str) -> bool:
    return key.startswith(SAFE) or key.endswith(SAFE_SUFFIXES)


def check_run_dir(run_dir: Path, cfg: Config, allow_config_change: bool, log):
    """Refuse a run folder the run cannot use, before any work, writing nothing; returns `commit()`,
    which creates the folder and writes config.yaml (process 0, once the rest has been checked)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"train.run_dir: {run_dir} is a file, not a folder; give a folder for the run")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise ValueError(f"train.run_dir: {run_dir} cannot be written ({existing} is not writable)")
    new, saved_path = to_dict(cfg), run_dir / "config.yaml"
    steps = manager(run_dir / "checkpoints", create=False).all_steps() if (run_dir / "checkpoints").is_dir() else []
    old = newest_meta(manager(run_dir / "checkpoints", create=False)).get("config") if steps else None
    try:
        on_disk = yaml.safe_load(saved_path.read_text()) if saved_path.exists() else None
    except yaml.YAMLError:
        on_disk = None
    if steps and old is None:  # checkpoints from before configs were saved in them
        old = on_disk
        if not isinstance(old, dict):
            raise ValueError(f"train.run_dir: {run_dir} holds checkpoints but its config.yaml is empty or unreadable "
                             "and the checkpoints hold no config; restore config.yaml or use another train.run_dir")
    if old:
        try:  # keys added since the run was made read as their defaults, which keep what it computed
            old = to_dict(from_dict(old))
        except ValueError:
            pass  # a config this version cannot read: compared as it is
    changed = differences(old, new) if old else []
    meaningful = [c for c in changed if not _safe(c[0])]
    listed = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in meaningful)
    if meaningful and not allow_config_change:
        raise ValueError(f"train.run_dir: {run_dir} holds a run whose config differs ({listed}). Resuming would "
                         "change what the run computes: give another train.run_dir, or pass --allow-config-change "
                         "to resume with the new values")
    for k, a, b in changed:
        log(f"config change on resume: {k}: {a!r} -> {b!r}")

    def commit():
        run_dir.mkdir(parents=True, exist_ok=True)
        if meaningful:
            kept = run_dir / f"config.before-step{max(steps)}.yaml"
            kept.write_text(yaml.safe_dump(on_disk if isinstance(on_disk, dict) else old, sort_keys=False))
            log(f"config.yaml rewritten with the changes (--allow-config-change); the previous one is {kept}")
        elif old and on_disk is None:
            log(f"{saved_path} was missing, empty or unreadable: written again from the checkpoint's config")
        saved_path.write_text(yaml.safe_dump(new, sort_keys=False))

    return commit


def metrics_upto(path: Path, step: int, log) -> list[str]:
    """The lines of metrics.jsonl with step <= `step`, dropping a torn line (a kill mid-write)."""
    kept = []
    for i, line in enumerate(path.read_text().splitlines() if path.exists() else []):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log(f"{path}: line {i + 1} is torn (the run was stopped while writing it); dropped")
            continue
        if row.get("step", step + 1) <= step:
            kept.append(line)
    return kept
