# Both entry points create the virtual environment on first use. It gets torch 2.13.0
# first (a file on local disk), which the project's torch range then keeps.
PYTHON ?= python3.11
TORCH ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench test-matrix

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q 'torch==$(TORCH)'
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m torch_precompile demo

lint: $(BIN)/.installed
	$(BIN)/ruff check

test: lint
	$(BIN)/python -m pytest

# The suite on the newer torch and Python releases, one venv per pair (see .ci/matrix).
test-matrix:
	bash .ci/matrix
