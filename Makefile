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

.PHONY: run test test-quick lint format clean

$(VENV)/.installed: pyproject.toml Makefile src/ljperf/hooks/ljperf_startup.pth
	$(PYTHON) -m venv $(VENV)
	# torch first: on the project's machines torch==2.13.0 is a local CPU-build file; elsewhere pass
	# TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu' to avoid PyPI's CUDA build.
	$(PY) -m pip install -q $(TORCH)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/ljperf benchmark --model torch/llama-tiny --micro-batch 2 --seq-len 256 --steps 10

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PYTEST)

# The inner loop (2-3 minutes): the tests not marked slow, which still import and exercise every module of
# src/ljperf (tests/test_imports.py imports each)
test-quick: lint
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) build dist .pytest_cache
