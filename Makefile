# Two commands set everything up on a fresh clone: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
TORCH ?= torch==2.13.0
# pytest workers: two keep both of CI's cores busy while a test waits on a subprocess's start-up; a test file
# runs in one worker, which makes its module-scoped runs once. Files are handed out longest first
# (tests/conftest.py's LONGEST_FIRST; xdist would order them by their number of tests).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Bytecode: pip compiles every module it installs (transformers' thousands, most never imported), half of the
# install's time. Instead the venv's processes started from here write the bytecode of what they import, once: the
# project's machines set PYTHONDONTWRITEBYTECODE=1, under which each of the suite's few hundred processes would
# compile all it imports anew. Times: benchmarks/results/suite_times_cpu-2core_2026-12.md.
INSTALL := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

# make test-floor: the quick suite at the lowest versions pyproject.toml admits, in a venv of its own. PyPI's
# torch 2.10.0 is a CUDA build (about 3 GB with its libraries; it runs on a CPU); elsewhere pass
# FLOOR_TORCH='torch==2.10.0 --index-url https://download.pytorch.org/whl/cpu'.
FLOOR_VENV ?= .venv-floor
FLOOR_TORCH ?= torch==2.10.0
FLOOR := transformers==5.17.0 accelerate==1.1.0 deepspeed==0.17.0 rich==13.0.0 matplotlib==3.8.0 numpy==1.26.4

.PHONY: run test test-quick test-floor lint format clean

$(VENV)/.installed: pyproject.toml Makefile src/ljperf/startup_hooks/ljperf_startup.pth
	$(PYTHON) -m venv $(VENV)
	# torch first: on the project's machines torch==2.13.0 is a local CPU-build file; elsewhere pass
	# TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu' to avoid PyPI's CUDA build.
	$(INSTALL) $(TORCH)
	DS_BUILD_OPS=0 $(INSTALL) -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/ljperf benchmark --model torch/llama-tiny --micro-batch 2 --seq-len 256 --steps 10

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/codespell src docs README.md
	$(VENV)/bin/pyrefly check --python-interpreter-path $(VENV)/bin/python

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PYTEST)

# The inner loop (budget: 3 minutes with lint): the tests not marked slow, which still import and exercise every
# module of src/ljperf (tests/test_imports.py imports each)
test-quick: lint
	$(PYTEST) -m "not slow"

$(FLOOR_VENV)/.installed: pyproject.toml Makefile src/ljperf/startup_hooks/ljperf_startup.pth
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --no-compile $(FLOOR_TORCH)
	DS_BUILD_OPS=0 $(FLOOR_VENV)/bin/python -m pip install -q --no-compile $(FLOOR) -e '.[dev]'
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build dist .pytest_cache
