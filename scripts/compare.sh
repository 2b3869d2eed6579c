#!/usr/bin/env bash
# The main job: set up .venv if needed, then run baseline vs solution on the embedded default
# workload (full-size stand-in on a CUDA GPU, tiny stand-in on a CPU) and print the report.
# Extra arguments go to bench.compare (e.g. --model PATH --data FILE for the real ones).
# Relative paths in them are the caller's: bench.compare resolves them against $BENCH_CALLER_CWD,
# the directory this script was started from, not against the repo it changes into.
set -euo pipefail
export BENCH_CALLER_CWD="$PWD"
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python -m bench.compare "$@"
