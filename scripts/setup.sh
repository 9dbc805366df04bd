#!/usr/bin/env bash
# Creates .venv with everything the project and its tests need. Idempotent.
# torch==2.13.0 goes in first: on CPU-only machines a looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
