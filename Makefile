PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test demo bench clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plot]'
	touch $(BIN)/activate

install: $(BIN)/activate

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/prepos demo

bench: install
	$(BIN)/python benchmarks/engine_paths.py

clean:
	rm -rf $(VENV) .pytest_cache
