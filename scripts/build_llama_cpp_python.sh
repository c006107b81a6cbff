#!/usr/bin/env bash
# Build the llama-cpp-python wheel (the in-process llama.cpp back end) from its PyPI sdist, once,
# with the flags of llama_cpp_flags.sh, and install it into $PYTHON's environment.
#
# The wheel is cached at $LLAMA_CACHE/wheels/<version>-<flags hash>/ (LLAMA_CACHE default:
# .cache/llama-cpp), so a second install with the same version and flags is instant and a change
# of flags builds anew (pip's own wheel cache would not notice CMAKE_ARGS). About 3.5 minutes on
# 2 cores. Exit status non-zero if it could not build; the torch back end works without it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/llama_cpp_flags.sh"
CACHE="${LLAMA_CACHE:-$ROOT/.cache/llama-cpp}"
PY="${PYTHON:-python3}"
DIR="$CACHE/wheels/$LLAMA_CPP_PYTHON_VERSION-$LLAMA_FLAGS_TAG"
wheel=$(find "$DIR" -maxdepth 1 -name 'llama_cpp_python-*.whl' 2>/dev/null | head -1 || true)
if [[ -z "$wheel" ]]; then
  command -v c++ >/dev/null || { echo "a C++ compiler is required" >&2; exit 2; }
  mkdir -p "$DIR"
  start=$(date +%s)
  # The binding's own multimodal library is not needed by prepos.
  CMAKE_ARGS="$LLAMA_CMAKE_FLAGS -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="${LLAMA_BUILD_JOBS:-2}" \
    nice -n 19 "$PY" -m pip wheel -q --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$DIR" >"$DIR/build.log" 2>&1 \
    || { tail -30 "$DIR/build.log" >&2; rm -f "$DIR"/*.whl; exit 5; }
  wheel=$(find "$DIR" -maxdepth 1 -name 'llama_cpp_python-*.whl' | head -1)
  echo "built $(basename "$wheel") in $(( $(date +%s) - start ))s" >&2
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" -m pip install -q "diskcache>=5.6" "typing-extensions>=4.5"
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
