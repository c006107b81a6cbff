#!/usr/bin/env bash
# Wheels for the packages prepos needs that the device machine's image (Python 3.12, its own
# torch and transformers; see /work/.library/device/KINDS.md) does not hold, downloaded here
# into .whl/ (git-ignored) so a device run can carry them:
#   scripts/device_wheels.sh
#   run: carry [".whl"], command "python3 -m pip install -q --no-index --no-deps --target
#        /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && benchmarks/gpu.sh ..."
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
# versions as in this project's environment; pure-Python ones need no platform tags
for spec in fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 annotated-types==0.8.0 \
            typing-inspection==0.4.5 uvicorn==0.54.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any -d .whl "$spec"
done
for spec in pydantic_core==2.50.5 httptools==0.9.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
