#!/usr/bin/env bash
# Execute notebooks/kaggle_t4.ipynb headless, end to end, from this checkout (the notebook finds the
# project from the working directory: no clone), and keep its output in OUT_DIR:
#   bash scripts/run_notebook.sh OUT_DIR [--set NAME=VALUE ...] [--engine plain|jupyter] [--dry-run]
# e.g. --set FULL=True (the full set), --set MODEL_DIR=/path/to/Qwen2.5-1.5B-Instruct.
# OUT_DIR gets kaggle_t4.ipynb (the executed notebook), kaggle_t4.log (the plain runner's output)
# and the notebook's t4-report-<run>.zip (the report folder). The runner is scripts/run_notebook.py:
# a Jupyter kernel where nbclient and ipykernel are installed, else exec of the code cells in one
# namespace in this Python.
# No network (the lent GPU machine): with wheels in .whl/ (scripts/fetch_gpu_wheels.sh) they are
# installed into /tmp/site as scripts/gpu_run.sh does, unless they import already, and exposed as
# PYTHONPATH=/tmp/site:$PWD; SOLUTION_WHEELS points the notebook's install step (scripts/t4_run.sh)
# at them, which then installs only what is missing. Hugging Face stays offline.
# Env: PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash scripts/run_notebook.sh OUT_DIR [--set NAME=VALUE ...] [--dry-run]" >&2; exit 2; }
out=$1
shift
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  export SOLUTION_WHEELS=${SOLUTION_WHEELS:-$PWD/.whl}
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  if ! "$PY" -c "import soup_cli, trl, bitsandbytes, datasets" 2>/dev/null; then
    echo "[run_notebook] installing the wheels of .whl/ into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
  fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
start=$(date +%s)
rc=0
"$PY" scripts/run_notebook.py notebooks/kaggle_t4.ipynb "$out" "$@" || rc=$?
# The zip cell writes into the notebook's working directory (here: this checkout): keep it with the rest.
for z in t4-report-*.zip; do [ -f "$z" ] && mv -f "$z" "$out"/; done
echo "[run_notebook] exit $rc after $(( $(date +%s) - start )) s; output in $out"
exit $rc
