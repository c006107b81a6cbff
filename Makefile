PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test demo serve bench simulate llama-server clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/activate

install: $(BIN)/activate

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/prepos demo

serve: install
	$(BIN)/prepos serve

llama-server: install
	PYTHON=$(BIN)/python scripts/build_llama_server.sh

simulate: install
	$(BIN)/prepos simulate --check

bench: install
	$(BIN)/prepos bench

clean:
	rm -rf $(VENV) .pytest_cache
