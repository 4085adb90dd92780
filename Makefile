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

.PHONY: install test demo bench clean proto

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

demo: install
	$(BIN)/python -m lumen_core.cli demo

bench: install
	$(BIN)/python -m pytest bench --benchmark-only -p no:cacheprovider

# Python stubs of the gateway's gRPC service, committed beside the .proto (tests/gateway checks
# they are current). Needs grpcio-tools (the `test` extra).
PROTO := src/lumen_core/gateway/lumen.proto
proto: $(BIN)/python
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src $(PROTO)

clean:
	rm -rf $(VENV) build dist
