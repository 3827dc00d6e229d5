# Both entry points create the virtual environment on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m torch_precompile demo

lint: $(BIN)/.installed
	$(BIN)/ruff check

test: lint
	$(BIN)/python -m pytest
