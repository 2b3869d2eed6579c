#!/usr/bin/env bash
# Creates .venv (if missing) with the exact workload stack: soup-cli 0.77.0 and its pins,
# bitsandbytes, peft, trl, Triton, PyTorch, and this project (editable). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# What the editable install below builds with (--no-build-isolation uses this venv's own packages
# and does not enforce pyproject's build requirements): a fresh Python 3.11 venv has setuptools
# 65.5 and no wheel, and torch brings setuptools only on Python 3.12+, so bring them first.
build_prerequisites() {
  python -m pip install -q "setuptools>=68" wheel
}
stamp=.venv/.project-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # PyTorch first: an already-present torch is kept; otherwise 2.13.0 (CPU build on the dev
  # machines, taken from their local disk; CUDA build from PyPI elsewhere).
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q "triton==3.6.0"
  build_prerequisites
  python -m pip install -q --no-build-isolation -e ".[workload,test]"
  touch "$stamp"
fi
