#!/usr/bin/env bash
# Run the same baseline-vs-solution comparison on a real NVIDIA T4 (Kaggle or Colab notebook,
# "GPU T4" accelerator, internet on), in the notebook's own Python (its PyTorch and the Triton
# bundled with it are kept: a pip constraints file, checked after the install). In a notebook cell:
#   !git clone <this repo> soup-kernels && cd soup-kernels && bash scripts/t4_run.sh
# Prints the same report as scripts/compare.sh and writes runs/<timestamp>/report.{md,json,png}.
# T4_FULL=1 (the default here): the GPU test suite, then bench.compare's GPU default (every dataset
# shape, the cold pass, profiled and host-split passes). T4_FULL=0 (the notebook's quick default):
# no tests, `bench.compare --runs shipped --no-host-split`: the shipped data timed (baseline and
# solution), profiled, and the rule check. SOLUTION_WHEELS=DIR (no network): the packages come from
# the wheels in DIR (pip --no-index --find-links DIR), and only those not already installed.
# With T4_VARIANTS=1 it then also profiles the solution's settings side by side, timed runs included
# (step time): runs/variants-t4/variants.md, 10 more runs (5 settings, each profiled and timed). Each
# differs from "default" in ONE thing: "balanced", "memory" (memory policies), "eager" (no CUDA graphs),
# "bucket64" (64-token buckets).
set -euo pipefail
cd "$(dirname "$0")/.."
# One GPU: on Kaggle's "GPU T4 x2" the Trainer would otherwise spread the run over both cards
# (another workload than the challenge's one T4), for baseline and solution alike. Two cards seen
# before that: the one test that needs both (a model spread over two GPUs) runs on them first.
pinned=${CUDA_VISIBLE_DEVICES:-}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"
# Keep this machine's PyTorch and Triton: a torch from PyPI may be built for a newer CUDA than the
# machine's driver runs (then no GPU at all). pip reads the versions to keep from the constraints
# file $PIP_CONSTRAINT: the notebook writes one; without it, this script writes one here, from what
# is installed. After the install the same versions must be there and CUDA must still work.
pins() {
  python3 -c 'import importlib.metadata as m
for d in ("torch", "triton", "torchvision", "torchaudio"):
    try: print(f"{d}=={m.version(d)}")
    except m.PackageNotFoundError: pass'
}
before=$(pins)
if [ -z "${PIP_CONSTRAINT:-}" ]; then
  PIP_CONSTRAINT=$(mktemp --suffix=-constraints.txt)
  echo "$before" > "$PIP_CONSTRAINT"
  export PIP_CONSTRAINT
fi
echo "pip constraints ($PIP_CONSTRAINT): $(tr '\n' ' ' < "$PIP_CONSTRAINT")"
if [ -n "${SOLUTION_WHEELS:-}" ]; then
  # Offline: the project runs from this checkout (python -m from its root); of its requirements only
  # the ones not installed yet are installed, from the wheels in $SOLUTION_WHEELS.
  missing=$(python3 - <<'PY'
# missing requirements of .[workload,test]: distribution names, one a line
import importlib.metadata as md, re, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = meta["dependencies"] + [r for extra in ("workload", "test") for r in meta["optional-dependencies"][extra]]
for req in reqs:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(name)
PY
)
  if [ -z "$missing" ]; then
    echo "SOLUTION_WHEELS: every requirement is installed already; nothing to install"
  else
    echo "SOLUTION_WHEELS: installing from $SOLUTION_WHEELS: $(echo $missing)"
    for dist in $missing; do  # one by one: a package without a wheel there does not stop the others
      python3 -m pip install -q --no-index --find-links "$SOLUTION_WHEELS" "$dist" \
        || echo "warning: $dist not installed from $SOLUTION_WHEELS; continuing without it"
    done
  fi
else
  python3 -m pip install -q --no-build-isolation -e ".[workload,test]"
fi
after=$(pins)
if [ "$before" != "$after" ]; then
  echo "error: the install changed this machine's torch / Triton: $(echo $before) -> $(echo $after)" >&2
  exit 2
fi
if ! python3 -c "import torch; assert torch.cuda.is_available()"; then
  echo "error: after the install torch.cuda.is_available() is False" >&2
  exit 2
fi
echo "kept after the install: $(echo $after); CUDA available"
quick=()
if [ "${T4_FULL:-1}" = "1" ]; then
  if [ -z "$pinned" ] && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ]; then
    env -u CUDA_VISIBLE_DEVICES python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_several_gpus.py \
      || echo "two-GPU test failed (see above); comparison continues"
  fi
  python3 -m pytest -q -m gpu -p no:cacheprovider tests || echo "GPU tests failed (see above); comparison continues"
else
  echo "quick comparison (T4_FULL=0): no GPU tests; the shipped data only, timed and profiled, no host split"
  quick=(--runs shipped --no-host-split)
fi
rc=0
python3 -m bench.compare "${quick[@]}" "$@" || rc=$?  # non-zero when a rule check fails: the report says which
# The solution's host-split pass logged which of our kernels Triton compiled (bench/compile_log.py):
# keep them in solution/kernels/compile_manifest.json, so that the background precompile (on by
# default) has this GPU's records too next time (commit the file to keep it; solution/precompile.py).
# The comparison's folder: its --out (the notebook passes one), else the newest runs/<timestamp>.
out="" prev=""
for a in "$@"; do
  [ "$prev" = "--out" ] && out=$a
  case $a in --out=*) out=${a#--out=} ;; esac
  prev=$a
done
[ -n "$out" ] || out=$(ls -td runs/*/ 2>/dev/null | grep -v variants | head -1 || true)
out=${out%/}
log=$out/solution-hostsplit/compiles.json
if [ -n "$out" ] && [ -f "$log" ]; then python3 -m solution.precompile add "$log" || true; fi
# This GPU's own figures beside the H200's in docs/PERFORMANCE.md: each of our kernels' achieved
# bandwidth in the profiled pass, against a copy measured on this GPU (bench/kernel_rates.py), and
# the launch-configuration model (bench/launch_table.py); and what the background precompile costs
# on this notebook's CPUs, with the compile processes' torch stand-in and with the real torch in turn
# (bench/precompile_timing.py; ~40 s on the project's 2-core CPU machine).
# They go next to the report (and into the notebook's zip).
if [ -n "$out" ] && [ -f "$out/solution-profiled/result.json" ]; then
  python3 -m bench.kernel_rates "$out/solution-profiled/result.json" --measure-copy | tee "$out/kernel_rates.md" || true
  python3 -m bench.launch_table > "$out/launch_table.md" 2>&1 || true
  python3 -m bench.precompile_timing --torch stand-in,real --json "$out/precompile_timing.json" | tee "$out/precompile_timing.md" || true
fi
if [ "${T4_VARIANTS:-0}" = "1" ]; then
  python3 -m bench.variants --out runs/variants-t4 --timed default balanced=SOLUTION_MEMORY_POLICY=balanced \
    memory=SOLUTION_MEMORY_POLICY=memory eager=SOLUTION_CUDA_GRAPHS=0 bucket64=SOLUTION_GRAPH_BUCKET=64
fi
exit $rc
