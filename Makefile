# Two commands set everything up on a fresh clone: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: run test lint format clean

$(VENV)/.installed: pyproject.toml Makefile src/ljperf/hooks/ljperf_startup.pth
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first (a local file here); GPU users install their own CUDA build.
	$(PY) -m pip install -q torch==2.13.0
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
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build dist .pytest_cache
