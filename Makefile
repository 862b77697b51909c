# Two commands run everything on a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.interlace-setup

.PHONY: setup demo test lint typecheck unit clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-venv.sh
	VENV=$(VENV) bash scripts/setup-venv.sh
	touch $(STAMP)

## The main job: resnet20 on the embedded digits data, 4 ranks, prints the final test accuracy.
demo: setup
	$(BIN)/interlace demo

## Lint, type-check and run the test suite.
test: setup lint typecheck unit

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: setup
	$(BIN)/mypy

## Test files spread over the cores (a file's tests stay together: they share launched ranks).
unit: setup
	$(BIN)/python -m pytest -n auto --dist loadfile

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
