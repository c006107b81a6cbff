#!/usr/bin/env bash
# Wheels for the packages prepos needs beyond torch and transformers (the web stack), for a
# GPU host without internet access that has its own torch and transformers (Python 3.12).
# Downloaded into .whl/ (git-ignored) on a machine with access; copy the checkout with .whl/
# to the host, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site && benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
# versions as in this project's environment; pure-Python ones need no platform tags
for spec in fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 annotated-types==0.8.0 \
            typing-inspection==0.4.5 uvicorn==0.55.0 \
            opentelemetry-api==1.45.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any -d .whl "$spec"
done
for spec in pydantic_core==2.50.5 httptools==0.9.0 orjson==3.13.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
