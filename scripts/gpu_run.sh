#!/usr/bin/env bash
# One call on a CUDA machine that has torch, triton, transformers, peft and accelerate but no
# network (the lent GPU machine): install the carried wheels (.whl/, from
# scripts/fetch_gpu_wheels.sh), check versions, run the GPU tests, the sm_75 compile check,
# the per-kernel benchmarks and the full-size baseline-vs-solution comparison.
#   bash scripts/gpu_run.sh [tests] [bench] [compare] [compare-shapes] [compare-cold] [compare-all] [runs] [cprofile]
#                           [hostsplit] [memory] [origins] [variants] [timed]
#   (default: the first three)
# Named runs (bench/runs.py; each a baseline-vs-solution comparison under stated conditions):
#   RUNS=shipped,shipped-graphs-off bash scripts/gpu_run.sh runs
# runs bench.compare --runs "$RUNS" into $OUT/runs-<names joined by +>, its summary.json and report.md
# copied beside results.tgz as runs-<names joined by ->-summary.json / -report.md. The whole named set:
# scripts/gpu_pipeline.sh with scripts/named_set.plan (its stages in turn in one background process across
# calls). Stage times on one H100 with a slow host (2026-12-07, wall time): warm-up run 79 s, ckpt +
# gpu-bound-sm16 243 s, long + short + outliers + shipped-same-allocator 432 s, shipped (profiled) 361 s,
# shipped-cold 114 s, shipped-graphs-off x3 310 s, gpu-bound-sm8 x3 ~420 s, tests ~150 s: ~2,100 s with
# the machine's start, more than a session's 1,800 s of device time (a fast host's four calls took ~1,390 s).
# On such a host run the set in two sessions on one commit: check that commit out for the second session's
# calls, so that every run carries it.
# then, here, from the calls' unpacked results.tgz: one report with every run and the call each came from
# (the T4 projection and the partition's prediction need the shipped runs' results):
#   python -m bench.rebuild_report DIR_1/runs-... DIR_2/runs-... ... --into ALL_DIR
# The comparison in three steps, each meant for its own 10-minute call (not yet timed): compare (the shipped
# shape: timed, profiled and host-split passes; no cold pass), compare-shapes (the long and short
# dataset shapes: timed and profiled), compare-cold (the shipped shape again with the cold pass,
# empty Triton/Inductor caches); compare-all is bench.compare's GPU default, all of them in one call of
# bench.compare (one report; longer than 10 minutes with the host split: start it with setsid and
# collect it in a later call). Each writes $OUT/<step>/summary.json, copied beside results.tgz as
# <step>-summary.json; merge them with
#   python -m bench.summary_merge compare-summary.json compare-shapes-summary.json compare-cold-summary.json -o summary.json
# (done here too, into summary.json, when one call ran more than one of them). Set BENCH_COMMIT
# to the commit being measured (this copy of the tree has no .git): the merge refuses different commits.
# Env: TESTS (test files, default tests/), BENCHES (bench_* names), COMPARE_ARGS (e.g. --no-profile;
#      added to each compare step's own options, so it can override them),
#      VARIANTS (bench.variants labels, e.g. "eager=SOLUTION_CUDA_GRAPHS=0 memory=SOLUTION_MEMORY_POLICY=memory"),
#      VARIANT_ARGS (e.g. --baseline), TIMED_VARIANTS (timed solution runs, one table: "LABEL[=VAR=VALUE,...]
#      ...", a label starting with "baseline" runs the baseline, one starting with "old" the solution of the
#      tree in TIMED_OLD_TREE (scripts/commit_pairs.sh writes one); TIMED_COLD=1: each in its own empty Triton cache;
#      TIMED_EXTRA: bench.run_one options, @L for the label), TIMED_TIMEOUT, MEMORY_VARIANTS (default "solution"), ORIGINS_VARIANTS (default "solution"), ORIGINS_TIMEOUT,
#      CPROFILE_VARIANTS (default "baseline solution"), CPROFILE_TIMEOUT, HOSTSPLIT_VARIANTS, HOSTSPLIT_TIMEOUT,
#      COMPARE_TIMEOUT, TEST_TIMEOUT, TEST_WORKERS (pytest-xdist workers, one file each; default 6 on >= 12 CPUs with xdist, 0 serial), BENCH_TIMEOUT, VARIANTS_TIMEOUT, MEMORY_TIMEOUT.
# Results: everything under $WORK, packed into $OUT/results.tgz (the device tool brings back at
# most 8 files), with the comparison's report.md beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/out}
OUT=${WORK:-/tmp/gpuwork}
mkdir -p "$OUT" "$FINAL"
pack() {
  cp "$OUT"/compare/report.md "$FINAL"/ 2>/dev/null
  local d sums=()
  for d in compare compare-shapes compare-cold compare-all $(cd "$OUT" && ls -d runs-* 2>/dev/null); do
    local name=${d//+/-}  # the device tool brings back names of letters, digits, '.', '_' and '-' only
    if [ -f "$OUT/$d/summary.json" ]; then cp "$OUT/$d/summary.json" "$FINAL/$name-summary.json"; sums+=("$OUT/$d/summary.json"); fi
    [ "$d" != compare ] && [ -f "$OUT/$d/report.md" ] && cp "$OUT/$d/report.md" "$FINAL/$name-report.md"
  done
  [ ${#sums[@]} -gt 1 ] && python3 -m bench.summary_merge "${sums[@]}" -o "$FINAL/summary.json"
  # Soup's output dirs (adapter, checkpoint with optimizer state, tokenizer) stay behind: too big to carry.
  tar czf "$FINAL/results.tgz" --exclude='*/output' -C "$OUT" .
}
trap pack EXIT
steps=${*:-tests bench compare}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for d in ("triton", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "soup-cli", "datasets"):
    try: print(d, md.version(d))
    except Exception as e: print(d, "MISSING", e)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
rc=0
# run_each LABEL OPTION EXT TIMEOUT HEAD VARIANT...: one bench.run_one per variant on the full-size
# stand-in, with OPTION writing $OUT/LABEL-VARIANT.EXT; prints its first HEAD lines. $RUN_ONE_EXTRA
# (with LABEL and VARIANT substituted for @L and @V) adds options.
run_each() {
  local label=$1 opt=$2 ext=$3 limit=$4 lines=$5 v
  shift 5
  local M=.cache/models/qwen2.5-1.5b-instruct-standin-full
  python3 -c "from workload.model_standin import write_standin; write_standin('$M', size='full')" >/dev/null 2>&1
  for v in "$@"; do
    timeout "$limit" python3 -m bench.run_one --variant "$v" --model $M --data workload/data/kazakh_instructions.jsonl \
      --workdir "$OUT/$label-$v" "$opt" "$OUT/$label-$v.$ext" \
      $(echo "${RUN_ONE_EXTRA:-}" | sed "s/@L/$label/g; s/@V/$v/g") > "$OUT/$label-$v.log" 2>&1 || rc=1
    head -"$lines" "$OUT/$label-$v.$ext"
  done
}
for step in $steps; do
  case $step in
    tests)
      # TEST_WORKERS=N: N pytest-xdist workers, each test file in one worker (--dist loadfile); unset:
      # 6 where pytest-xdist imports and the machine has >= 12 CPUs (the lent H200: the whole suite in
      # ~150 s, ~500 s serial), else serial; 0: serial
      nw=${TEST_WORKERS:-}
      if [ -z "$nw" ]; then
        nw=0; python3 -c "import xdist" 2>/dev/null && [ "$(nproc)" -ge 12 ] && nw=6
      fi
      workers=(); [ "$nw" != 0 ] && workers=(-n "$nw" --dist loadfile)
      timeout ${TEST_TIMEOUT:-560} python3 -m pytest ${TESTS:-tests} -q -p no:cacheprovider "${workers[@]}" \
        -k "not test_every_kernel_compiles_for_sm75" 2>&1 | tee "$OUT/tests.log" | tail -25 || rc=1
      python3 -m solution.sm75_check 2>&1 | tee "$OUT/sm75.log" | tail -30 ;;
    bench)
      : > "$OUT/kernels.md"
      for n in ${BENCHES:-$(cd bench/kernels && ls bench_*.py | sed 's/\.py$//')}; do
        b=bench/kernels/$n.py
        timeout ${BENCH_TIMEOUT:-60} python3 "$b" --out "$OUT/$n.json" 2>&1 | tee -a "$OUT/kernels.md" | tail -20 || rc=1
      done ;;
    cprofile)
      # Where the host (Python) time of a step goes, stock and ours (separate runs, cProfile on).
      run_each cprofile --cprofile txt ${CPROFILE_TIMEOUT:-150} 45 ${CPROFILE_VARIANTS:-baseline solution} ;;
    hostsplit)
      # Where the wall time of a step goes, by Trainer phase (bench/host_split.py; separate runs).
      # Also logs Triton's compiles (bench/compile_log.py) to $OUT/compiles-VARIANT.md.
      RUN_ONE_EXTRA="--compile-log $OUT/compiles-@V.md" \
        run_each hostsplit --host-split md ${HOSTSPLIT_TIMEOUT:-150} 20 ${HOSTSPLIT_VARIANTS:-baseline solution}
      for f in "$OUT"/compiles-*.md; do head -12 "$f"; done ;;
    origins)
      # Which Python line launches each GPU kernel, with its GPU time, graphs off (bench/op_origins.py).
      SOLUTION_CUDA_GRAPHS=0 run_each origins --op-origins md ${ORIGINS_TIMEOUT:-240} 45 ${ORIGINS_VARIANTS:-solution} ;;
    memory)
      # What is alive at the peak of allocated memory, by allocating line (bench/memory_peak.py).
      run_each memory --memory-peak md ${MEMORY_TIMEOUT:-180} 32 ${MEMORY_VARIANTS:-solution} ;;
    timed)
      # Settings side by side, one unprofiled run each (bench/timed_table.py prints the table).
      M=$PWD/.cache/models/qwen2.5-1.5b-instruct-standin-full
      python3 -c "from workload.model_standin import write_standin; write_standin('$M', size='full')" >/dev/null 2>&1
      specs=()
      for spec in ${TIMED_VARIANTS:-default}; do
        label=${spec%%=*}; settings=""; [ "$label" != "$spec" ] && settings=${spec#*=}
        v=solution tree=$PWD
        case $label in
          baseline*) v=baseline ;;
          old*) tree=$(cd "${TIMED_OLD_TREE:-/nonexistent}" 2>/dev/null && pwd) \
                  || { echo "error: label $label needs TIMED_OLD_TREE (a tree from scripts/commit_pairs.sh)"; rc=1; continue; } ;;
        esac
        envs=(); IFS=, read -ra envs <<< "$settings"
        work=$(cd "$OUT" && pwd) data=$PWD/workload/data/kazakh_instructions.jsonl
        cache=$work/timed-$label/triton-cache; rm -rf "$cache"
        [ "${TIMED_COLD:-0}" = 1 ] && envs+=("TRITON_CACHE_DIR=$cache" "TORCHINDUCTOR_CACHE_DIR=$cache-inductor")
        # run from its tree with that tree's packages (PYTHONPATH ends with this tree's path: swapped)
        pp="${PYTHONPATH%"$PWD"}$tree"
        (cd "$tree" && env PYTHONPATH="$pp" "${envs[@]}" timeout ${TIMED_TIMEOUT:-150} python3 -m bench.run_one \
          --variant $v --model "$M" --data "$data" --workdir "$work/timed-$label" \
          $(echo "${TIMED_EXTRA:-}" | sed "s/@L/$label/g")) > "$OUT/timed-$label.log" 2>&1 || rc=1
        grep -h "^\[solution\]" "$OUT/timed-$label.log" | grep -v "^\[solution\] captured" | head -8
        specs+=("$label=$OUT/timed-$label/result.json")
      done
      python3 -m bench.timed_table "${specs[@]}" | tee "$OUT/timed.md" ;;
    variants)
      timeout ${VARIANTS_TIMEOUT:-540} python3 -m bench.variants --out "$OUT/variants" ${VARIANT_ARGS:-} ${VARIANTS:-default} 2>&1 | tail -30 || rc=1 ;;
    runs)
      # named runs (bench/runs.py), one bench.compare call: RUNS=name,name,... (COMPARE_ARGS added)
      if [ -z "${RUNS:-}" ]; then echo "error: set RUNS=name,name,... (bench/runs.py)"; rc=2; continue; fi
      d=runs-$(echo "$RUNS" | tr ',' '+')
      timeout ${COMPARE_TIMEOUT:-540} python3 -m bench.compare --runs "$RUNS" --out "$OUT/$d" ${COMPARE_ARGS:-} 2>&1 \
        | tail -60 || rc=1 ;;
    compare|compare-shapes|compare-cold|compare-all)
      case $step in
        compare-all) opts="" ;;  # bench.compare's GPU default: every shape and the cold pass (one report)
        compare) opts="--shapes shipped --no-cold" ;;
        compare-shapes) opts="--shapes long,short --no-cold --no-host-split" ;;
        compare-cold) opts="--shapes shipped --cold --no-host-split" ;;
      esac
      timeout ${COMPARE_TIMEOUT:-540} python3 -m bench.compare --out "$OUT/$step" $opts ${COMPARE_ARGS:-} 2>&1 | tail -60 || rc=1 ;;
  esac
done
exit $rc
