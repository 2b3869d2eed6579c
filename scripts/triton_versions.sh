#!/usr/bin/env bash
# Our kernels under other Triton versions, without a GPU: for each version, the sm_75 compile
# check (python -m solution.sm75_check), the precompile manifest's records compiled for
# sm_75 as the background precompile's child processes do (the records this version would use:
# solution/precompile.py entries_for), and the kernel tests in Triton's interpreter.
# Needs the project's .venv (scripts/setup_env.sh; PY=<python> runs another one, whose own
# packages stay as they are: each Triton goes to .cache) and ~2 GB of downloads (cached in
# .cache/triton-versions). Usage: [PY=<python>] bash scripts/triton_versions.sh [VERSION ...]
# (default: 3.0.0 3.1.0 3.2.0 3.3.1 3.4.0 3.5.1 3.7.1 3.8.0 3.9.0; the .venv's own Triton, 3.6.0,
# is the CI run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CACHE=.cache/triton-versions
mkdir -p "$CACHE"
TESTS="tests/test_launches.py tests/test_rmsnorm.py tests/test_swiglu.py tests/test_fp32_add.py
  tests/test_nf4_dequant.py tests/test_nf4_linear.py tests/test_lora_nf4.py tests/test_add_rmsnorm.py
  tests/test_lm_head_loss.py tests/test_nf4_mlp.py tests/test_unpad.py tests/test_attn_varlen.py"
for v in ${*:-3.0.0 3.1.0 3.2.0 3.3.1 3.4.0 3.5.1 3.7.1 3.8.0 3.9.0}; do
  d=$CACHE/$v
  if [ ! -d "$d/triton" ]; then
    $PY -m pip download -q --no-deps -d "$CACHE/wheels" "triton==$v" &&
      $PY -m pip install -q --no-deps --target "$d" "$CACHE"/wheels/triton-"$v"-*.whl || { echo "triton $v: install failed"; continue; }
  fi
  echo "== triton $v"
  echo -n "sm_75 compile check: "; PYTHONPATH=$d $PY -m solution.sm75_check 2>&1 | tail -1
  echo -n "precompile records for sm_75: "
  PYTHONPATH=$d:$PWD TRITON_CACHE_DIR=$(mktemp -d) $PY -c "
import triton
from solution import precompile
e = precompile.entries_for(precompile.load_manifest(precompile.MANIFEST), triton.__version__)
n = precompile._wait_workers(*precompile._start_workers(e, ('cuda', 75, 32), workers=2)) if e else 0
print(f'{n} of {len(e)} compiled (recorded with Triton {\", \".join(sorted({r[\"triton\"] for r in e})) or \"none usable\"})')
" 2>&1 | tail -1
  echo -n "kernel tests (interpreter): "
  PYTHONPATH=$d TRITON_INTERPRET=1 $PY -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -1
done
