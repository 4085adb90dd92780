# Quick start: `make demo` (install + main job) and `make test` (install + tests).
# Both create .venv themselves; nothing relies on what was installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Build switches (DESIGN.md section 10); .ci/run turns AUTO into ON so a missing module fails.
export LUMEN_CUDA ?= AUTO
export LUMEN_UCX ?= AUTO
export LUMEN_CUDA_ARCHS ?= 80;90
NATIVE_SOURCES := $(shell find csrc python -type f) CMakeLists.txt pyproject.toml
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.torch $(NATIVE_SOURCES) $(shell find src -name '*.py')
	$(BIN)/pip install -q ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Until the cluster demo exists, the demo is the gather benchmark's table.
demo: install
	$(BIN)/python bench/gather_bw.py

# Every bench script under pytest-benchmark (scripts are not named test_*, so list them).
bench: install
	$(BIN)/python -m pytest $(wildcard bench/*.py) --benchmark-only -p no:cacheprovider

clean:
	rm -rf $(VENV) build dist
