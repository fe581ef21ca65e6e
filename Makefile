# One set-up path: `make demo` runs the main job, `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specprefill demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/scoring.py
	$(BIN)/python bench/cache_store.py
	$(BIN)/python bench/queue.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/http.py

clean:
	rm -rf $(VENV) build *.egg-info
