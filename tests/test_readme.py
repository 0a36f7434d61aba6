"""Every code block of the README runs as written: each Python block in a fresh namespace from the
repository root; each YAML block is a config (or a part of one) that loads; each shell command
parses with its program's own argument parser and its config (or sweep grid) loads with its overrides. (`make`
lines are the suite and the default run themselves; a `python -m benchmarks...` command is run by
hand, its figures quoted beside it.)"""

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def blocks(language):
    found = [code for lang, code in BLOCKS if lang == language]
    assert found, f"the README has no {language} block"
    return found


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_python_block_runs(i, monkeypatch):
    from zoo import registry

    monkeypatch.chdir(ROOT)
    tables = [(t, dict(t)) for t in (registry.MIXERS, registry.FFNS, registry.LAYER_OF)]
    try:
        exec(compile(blocks("python")[i], f"README.md python block {i}", "exec"), {"__name__": "readme"})
    finally:  # a block may register a kind: leave the registry as shipped for the other tests
        for table, saved in tables:
            table.clear()
            table.update(saved)


@pytest.mark.parametrize("i", range(len(blocks("yaml"))))
def test_yaml_block_is_a_config(i):
    from zoo.config import from_dict

    from_dict(yaml.safe_load(blocks("yaml")[i]))


def commands():
    """Shell commands of the bash blocks: continuations joined, comments and `make` lines dropped."""
    out = []
    for code in blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment variables
                words = words[1:]
            if words and words[0] != "make":
                out.append(words)
    return out


@pytest.mark.parametrize("words", commands(), ids=lambda w: " ".join(w)[:60])
def test_shell_command_parses_and_its_config_loads(words):
    from infer.__main__ import parser as infer_parser
    from train.__main__ import parser as train_parser
    from zoo import load_config

    assert words[:2] == ["python", "-m"], words
    program, argv = words[2], words[3:]
    if program == "train":
        args = train_parser().parse_args(argv)
        load_config(ROOT / args.config, args.overrides)
    elif program == "infer":
        args = infer_parser().parse_args(argv)
        if args.source.endswith(".yaml"):
            load_config(ROOT / args.source, args.overrides)
        elif (ROOT / args.source / "config.json").is_file():  # a Hugging Face folder (zoo/hf)
            assert not args.overrides, "a folder takes no overrides"
        else:
            assert args.source.startswith("runs/") and not args.overrides, "a run folder takes no overrides"
    elif program == "train.prepare":
        from train.prepare import parser
        args = parser().parse_args(argv)
        load_config(ROOT / args.config, args.overrides)
    elif program == "train.sweep":
        from train import sweep
        sweep.cells(sweep.load_grid(ROOT / sweep.grid_path(sweep.parser().parse_args(argv))))  # every cell loads
    elif program == "train.extrapolate":
        from train.extrapolate import parser
        assert parser().parse_args(argv).run_dir.startswith("runs/")
    else:
        assert program.startswith("benchmarks."), program
        assert (ROOT / (program.replace(".", os.sep) + ".py")).exists(), program
