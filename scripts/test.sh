#!/usr/bin/env bash
# The project's test command: sets up .venv if needed, then runs every test.
# Without CUDA, kernels run in Triton's CPU interpreter and GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
