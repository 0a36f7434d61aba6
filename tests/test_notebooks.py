"""Every notebook in notebooks/ runs top to bottom at tiny sizes (a cell injected after its
`parameters` cell overrides them), shows progress where it trains, and none is committed with outputs.
At their committed sizes they run with `make notebooks`, too slow for the suite: here, each first cell
states that time, and the target runs every notebook."""

import os
import re
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TINY = {
    "mqar_comparison": 'kinds = ["attention", "gla"]\nwidths = [16]\nseq_len, pairs = 16, 2\nsteps = 4\nlrs = [3e-3]\n'
                       'out = "sweep"\nworkers = 1',
    "decode_cost": 'kinds = ["gqa", "gla"]\ncontexts = [16, 32]\nrepeats = 1',
    "inspect_run": f'run_dir = "run"\nconfig = "{ROOT / "configs" / "transformer.yaml"}"\nsteps_if_missing = 2\n'
                   'overrides = ["model.num_layers=1", "model.d_model=32", "train.batch_size=4", "train.eval_every=2",'
                   ' "train.sample_tokens=0"]\nprompt = "A"\nnew_tokens = 8',
    "layer_in_your_model": "steps = 3\nd_model = 16\nseq_len = 16\nbatch_size = 4",
}
PROGRESS = {  # what a notebook that trains prints while it does (at the tiny sizes)
    "mqar_comparison": r"2/2 cells: 100%\|.*\| 8/8 ",  # the sweep's bar over the grid's steps
    "inspect_run": r"step +2/2 +loss",  # the training loop's lines
    "layer_in_your_model": r"step 2: loss",
}


def test_every_notebook_has_tiny_parameters():
    assert {p.stem for p in NOTEBOOKS} == set(TINY)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_states_the_time_at_committed_sizes(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown" and re.search(r"about [\d.]+ minutes? on a 2-core CPU", first.source), \
        f"{path.name}: its first cell should say how long it runs as committed (about N minutes on a 2-core CPU)"


def test_make_notebooks_runs_every_notebook_as_committed():
    dry = subprocess.run(["make", "-n", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "notebooks/*.ipynb" in dry.stdout and "jupyter execute --timeout=-1" in dry.stdout  # no cell cut short
    assert "make notebooks" in (ROOT / "docs" / "experiments.md").read_text()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is committed with outputs: clear them"
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(TINY[path.stem]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    if path.stem in PROGRESS:
        printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert re.search(PROGRESS[path.stem], printed), f"{path.name} trains without showing progress"
