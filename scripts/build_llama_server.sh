#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source, once, and cache it.
#
# The source is the llama.cpp that the llama-cpp-python sdist vendors, and the flags are those
# of llama_cpp_flags.sh: the same code and the same build as the in-process llama.cpp back end
# (build_llama_cpp_python.sh), so the two compare like for like. The sdist is fetched with pip,
# so a clean clone needs only PyPI. Only the `llama-server` target is built, under nice, with
# LLAMA_BUILD_JOBS parallel jobs (default 2). The binary lands in
#   $LLAMA_CACHE/lcp-<version>-<flags hash>/bin/llama-server   (LLAMA_CACHE default: .cache/llama-server)
# and a second run with the same version and flags does nothing. Prints the binary's path as
# its last line. Tests find it through $PREPOS_LLAMA_SERVER or that default location.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/llama_cpp_flags.sh"
VERSION="$LLAMA_CPP_PYTHON_VERSION"
CACHE="${LLAMA_CACHE:-$ROOT/.cache/llama-server}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
PY="${PYTHON:-python3}"
OUT="$CACHE/lcp-$VERSION-$LLAMA_FLAGS_TAG"
BIN="$OUT/bin/llama-server"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi
command -v cmake >/dev/null || { echo "cmake is required (apt-get install cmake)" >&2; exit 2; }
command -v c++ >/dev/null || { echo "a C++ compiler is required" >&2; exit 2; }

start=$(date +%s)
work="$OUT/work"
rm -rf "$work" && mkdir -p "$work"
# --no-binary for the package itself only: its build requirements (cmake, setuptools) come as
# wheels, so preparing the sdist's metadata builds nothing.
"$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
  -d "$work"
sdist=$(find "$work" -maxdepth 1 -name 'llama[_-]cpp[_-]python-*.tar.gz' | head -1)
[[ -n "$sdist" ]] || { echo "no sdist of llama-cpp-python==$VERSION downloaded" >&2; exit 3; }
tar -xzf "$sdist" -C "$work"
src=$(find "$work" -mindepth 3 -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -1)
[[ -n "$src" ]] || { echo "the sdist vendors no llama.cpp" >&2; exit 3; }

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
# shellcheck disable=SC2086  # the flags are a word list
nice -n 19 cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  $LLAMA_CMAKE_FLAGS -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_USE_PREBUILT_UI=OFF >"$OUT/cmake-configure.log" 2>&1 \
  || { tail -30 "$OUT/cmake-configure.log" >&2; exit 4; }
nice -n 19 cmake --build "$work/build" --target llama-server -j "$JOBS" >"$OUT/cmake-build.log" 2>&1 \
  || { tail -30 "$OUT/cmake-build.log" >&2; exit 5; }
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-server" "$BIN"
rm -rf "$work"
echo "built llama-server $VERSION in $(( $(date +%s) - start ))s" >&2
"$BIN" --version >&2 || true
echo "$BIN"
