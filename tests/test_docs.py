"""The documentation works as written: the site builds with `mkdocs build --strict` (a broken link or
anchor, or a page missing from nav, fails it), and every code block of README.md and of each page
of docs/ runs. Each Python block runs in a fresh namespace from the repository root; each YAML block
is a config (or a part of one) that loads; each shell command parses with its program's own argument
parser and its config (or sweep grid) loads with its overrides. (`make` lines are the suite and the
default run themselves; a `python -m benchmarks...` command is run by hand, its figures quoted beside
it.) Blocks in another language (```text: output, equations, sketches) are not run. A block that
appears word for word in two files (the site's home page repeats the README's) runs once, its id
naming both."""

import importlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = ("python", "yaml", "bash")  # the languages the tests run; any other is shown, not run


def collect():
    """One (id, language, code) per distinct block; ids name the file, language and index in that file."""
    found = {}
    for path in FILES:
        name = path.relative_to(ROOT).as_posix()
        count = {}
        for lang, code in re.findall(r"^ *```(\w+)\n(.*?)^ *```", path.read_text(), flags=re.S | re.M):
            i = count[lang] = count.get(lang, -1) + 1
            found.setdefault((lang, textwrap.dedent(code)), []).append(f"{name}:{lang}{i}")
    return [pytest.param(lang, code, id="=".join(ids)) for (lang, code), ids in found.items() if lang in RUN]


BLOCKS = collect()


def test_site_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "index.html").is_file()


def test_every_block_names_its_language():
    """An unmarked block would be neither run nor known to be output: say `text` for what is not run."""
    for path in FILES:
        openers = re.findall(r"^ *```(\w*)$", path.read_text(), flags=re.M)[0::2]
        assert all(openers), f"{path.relative_to(ROOT)}: a code block without a language"


@pytest.mark.parametrize("lang, code", BLOCKS)
def test_block_runs(lang, code, monkeypatch, request):
    monkeypatch.chdir(ROOT)
    {"python": run_python, "yaml": load_yaml, "bash": parse_commands}[lang](code, request.node.callspec.id)


def run_python(code, name):
    from zoo import registry

    tables = [(t, dict(t)) for t in (registry.MIXERS, registry.FFNS, registry.LAYER_OF)]
    try:
        exec(compile(code, name, "exec"), {"__name__": "docs"})
    finally:  # a block may register a kind: leave the registry as shipped for the other tests
        for table, saved in tables:
            table.clear()
            table.update(saved)


def load_yaml(code, name):
    from zoo.config import from_dict

    from_dict(yaml.safe_load(code))


def commands(code):
    """Shell commands of a bash block: continuations joined, comments, environment variables and `make`
    lines dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_0-9]+=\S*", words[0]):  # environment variables
            words = words[1:]
        if words and words[0] != "make":
            out.append(words)
    return out


def parse_commands(code, name):
    assert commands(code) or "make" in code, f"{name}: no command"
    for words in commands(code):
        try:
            parse_command(words)
        except BaseException as e:  # argparse exits with SystemExit: name the command that failed
            raise AssertionError(f"{name}: {shlex.join(words)}") from e


def parse_command(words):
    if words[0] == "pip":
        return check_pip(words[1:])
    if words[0] == "mkdocs":
        from mkdocs.__main__ import cli
        return cli.commands[words[1]].make_context(shlex.join(words[:2]), words[2:])  # click's own parsing
    from infer.__main__ import parser as infer_parser
    from train.__main__ import parser as train_parser
    from zoo import load_config

    assert words[:2] == ["python", "-m"], words
    program, argv = words[2], words[3:]
    if program == "train":
        args = train_parser().parse_args(argv)
        load_config(ROOT / args.config, args.overrides)
    elif program in ("infer", "infer.serve"):  # the same sources
        args = (infer_parser() if program == "infer" else importlib.import_module(program).parser()).parse_args(argv)
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
    elif program in ("train.extrapolate", "train.needle", "train.hybrid"):  # a finished run's folder
        assert importlib.import_module(program).parser().parse_args(argv).run_dir.startswith("runs/")
    elif program == "train.distill":  # a teacher's folder
        assert importlib.import_module(program).parser().parse_args(argv).teacher.startswith("runs/")
    elif program == "train.harness":  # lm-eval's own command line (docs/evaluation.md)
        from unittest import mock

        from lm_eval._cli import HarnessCLI
        with mock.patch.object(sys, "argv", ["lm_eval", *argv]):
            assert HarnessCLI().parse_args().model == "zoo"
    else:
        assert program.startswith("benchmarks."), program
        assert (ROOT / (program.replace(".", os.sep) + ".py")).exists(), program


def check_pip(argv):
    """`pip install`: this project with extras it declares, or requirement specifiers that parse."""
    from packaging.requirements import Requirement

    assert argv[0] == "install", argv
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in (a for a in argv[1:] if not a.startswith("-")):
        if spec.startswith("."):
            assert set(re.fullmatch(r"\.\[([\w,]+)\]", spec).group(1).split(",")) <= set(extras), spec
        else:
            Requirement(spec)
