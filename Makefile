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

# The suite on every core and one more: each test worker has its own Redis, ports and folders;
# tests that share an expensive fixture run on one worker (tests/conftest.py). About a fifth of
# the suite's time is tests waiting on processes, restarts and timeouts: the extra worker fills
# it (2 cores: 10 min 57 s on two workers, 8 min 33 s on three). TEST_WORKERS=0: one process.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print((os.cpu_count() or 1) + 1)')
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench.scoring
	$(BIN)/python -m bench.block_store
	$(BIN)/python -m bench.jobqueue
	$(BIN)/python -m bench.quality
	$(BIN)/python -m bench.ttft
	$(BIN)/python -m bench.http_api

clean:
	rm -rf $(VENV) build *.egg-info
