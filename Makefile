# Both entry points create the virtual environment on first use, in either order. It gets
# torch 2.13.0 first (a file on local disk), which the project's torch range then keeps.
# The demo needs only torch and the package (stamp .installed-base); lint and test add the
# development tools of the dev extra to the same venv (stamp .installed).
PYTHON ?= python3.11
TORCH ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-quick lint bench test-matrix zoo

$(BIN)/.installed-base: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q 'torch==$(TORCH)'
	$(BIN)/python -m pip install -q -e .
	touch $@

$(BIN)/.installed: $(BIN)/.installed-base
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.installed-base
	$(BIN)/python -m torch_precompile demo

lint: $(BIN)/.installed
	$(BIN)/ruff check
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

# A quick subset while working: the eager backend only, without the distributed worlds, the
# pipelines and restarts, the documentation's fresh processes and the soaks (see
# docs/development.md). make test runs everything.
test-quick: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not soak" -k "not inductor" --ignore=tests/test_distributed.py \
		--ignore=tests/test_pipeline.py --ignore=tests/test_elastic.py --ignore=tests/test_docs.py

# The suite on the newer torch and Python releases, one venv per pair (see .ci/matrix).
test-matrix:
	bash .ci/matrix

# The model zoo (benchmarks/zoo.py): real architectures from transformers, timm, torchvision
# and torch.nn, random init, each built and reloaded in a fresh process and compared with eager.
# Its own venv, on torch 2.14.1 (torchvision for 2.13 does not import here). Extra arguments in
# ZOO_ARGS, e.g. make zoo ZOO_ARGS='--backends eager --cases gpt2,bert'.
ZOO_TORCH ?= 2.14.1
ZOO_TORCHVISION ?= 0.29.1
ZOO_VENV := .venv-zoo
ZOO_BIN := $(ZOO_VENV)/bin
ZOO_ARGS ?=

$(ZOO_BIN)/.installed: pyproject.toml
	test -x $(ZOO_BIN)/python || $(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_BIN)/python -m pip install -q --upgrade pip
	$(ZOO_BIN)/python -m pip install -q 'torch==$(ZOO_TORCH)' 'torchvision==$(ZOO_TORCHVISION)' \
		timm transformers numpy
	$(ZOO_BIN)/python -m pip install -q -e .
	touch $@

zoo: $(ZOO_BIN)/.installed
	$(ZOO_BIN)/python benchmarks/zoo.py $(ZOO_ARGS)
