# tailcut — `make run` trains the embedded default, `make test` runs lint, types and tests.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test test-lowest lint fmt typecheck pytest bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[torch,ray,dev,wandb]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/tailcut train configs/arith-tiny.yaml

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/lint-imports

fmt: install
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest -q

test: lint typecheck pytest

# The engine and chat-template tests at the lowest transformers pyproject.toml declares.
test-lowest: install
	bash scripts/lowest_transformers.sh

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
