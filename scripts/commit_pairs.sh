#!/usr/bin/env bash
# Timed runs of this tree's solution and an older commit's, with the baseline, interleaved on ONE machine
# (bench.run_one, the full-size stand-in, the shipped data; one bench.timed_table at the end): whether a
# host-bound ratio moved with the code or with the host. Default: graphs off (the eager step).
#   here:    bash scripts/commit_pairs.sh prepare SHA        # SHA's solution/ bench/ workload/ into $OLD_DIR
#   device:  bash scripts/commit_pairs.sh start [SECONDS]    # run tool carry: [".whl", ".cache/old"]
#            bash scripts/commit_pairs.sh poll [SECONDS]     # later calls; each copies timed.md and diag.tgz to $OUT
# Arms: B baseline (this tree); N this tree's solution; O the old tree's solution; Od the old tree's with
# $OLD_EXTRA too (default SOLUTION_DIRECT_LAUNCH=0). Every solution arm gets $SETTINGS (default
# SOLUTION_CUDA_GRAPHS=0). $ROUNDS rounds (default 3), each in the order of the one before rotated by one,
# so that no arm always runs first. No warm-up run: the precompile ends before training even from an
# empty cache, so steps 3-64 are clean. Each poll's table holds the runs ended so far.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD_DIR=${OLD_DIR:-.cache/old}
P=${PAIRS_DIR:-/tmp/commit-pairs}
cmd=${1:-poll}
case $cmd in
  prepare)
    sha=${2:-}
    git rev-parse -q --verify "${sha:-none}^{commit}" >/dev/null 2>&1 \
      || { echo "error: prepare needs a commit of this repository (got '${sha}')"; exit 2; }
    rm -rf "$OLD_DIR" && mkdir -p "$OLD_DIR" \
      && git archive "$sha" solution bench workload pyproject.toml | tar -x -C "$OLD_DIR" \
      && git rev-parse "$sha" > "$OLD_DIR/COMMIT" || { echo "error: could not write $OLD_DIR"; exit 2; }
    echo "$OLD_DIR: $(cat "$OLD_DIR/COMMIT") ($(du -sh "$OLD_DIR" | cut -f1))"
    exit 0 ;;
  start)
    [ -f "$OLD_DIR/COMMIT" ] || { echo "error: no $OLD_DIR/COMMIT: run 'prepare SHA' here and carry $OLD_DIR"; exit 2; }
    [ -e "$P" ] && { echo "error: $P exists: a run already started on this machine"; exit 2; }
    mkdir -p "$P"
    setsid bash "$0" body < /dev/null > "$P/body.log" 2>&1 &
    exec bash "$0" poll "${2:-540}" ;;
  body)
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    fi
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    root=$PWD old=$(cd "$OLD_DIR" && pwd)
    M=$root/.cache/models/qwen2.5-1.5b-instruct-standin-full
    PYTHONPATH=/tmp/site:$root python3 -c "from workload.model_standin import write_standin; write_standin('$M', size='full')"
    nvidia-smi --query-gpu=name --format=csv,noheader; echo "old tree: $(cat "$old/COMMIT")"
    read -ra settings <<< "${SETTINGS:-SOLUTION_CUDA_GRAPHS=0}"
    read -ra extra <<< "${OLD_EXTRA:-SOLUTION_DIRECT_LAUNCH=0}"
    one() {  # LABEL TREE VARIANT ENV...
      local label=$1 tree=$2 v=$3; shift 3
      echo "$(date +%T) $label"
      (cd "$tree" && env PYTHONPATH="/tmp/site:$tree" "$@" timeout "${RUN_TIMEOUT:-240}" python3 -m bench.run_one \
        --variant "$v" --model "$M" --data "$root/workload/data/kazakh_instructions.jsonl" --workdir "$P/w-$label") \
        > "$P/$label.log" 2>&1 || echo "  rc $? ($P/$label.log)"
    }
    arms=(B N O Od)
    for ((r = 1; r <= ${ROUNDS:-3}; r++)); do
      for arm in "${arms[@]}"; do
        case $arm in
          B) one "B$r" "$root" baseline ;;
          N) one "N$r" "$root" solution "${settings[@]}" ;;
          O) one "O$r" "$old" solution "${settings[@]}" ;;
          Od) one "Od$r" "$old" solution "${settings[@]}" "${extra[@]}" ;;
        esac
      done
      arms=("${arms[@]:1}" "${arms[0]}")
    done
    touch "$P/done"
    exit 0 ;;
  poll)
    [ -d "$P" ] || { echo "error: no run on this machine ($P missing)"; exit 2; }
    deadline=$((SECONDS + ${2:-540}))
    while [ ! -e "$P/done" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    tail -6 "$P/body.log"
    specs=()
    for f in "$P"/w-*/result.json; do
      [ -f "$f" ] && specs+=("$(basename "$(dirname "$f")" | sed 's/^w-//')=$f")
    done
    [ ${#specs[@]} -gt 0 ] && PYTHONPATH=/tmp/site:$PWD python3 -m bench.timed_table "${specs[@]}" > "$P/timed.md"
    if [ -n "${OUT:-}" ]; then
      cp "$P/timed.md" "$OUT/" 2>/dev/null
      tar czf "$OUT/diag.tgz" --exclude='*/output' -C "$P" . 2>/dev/null
    fi
    [ -e "$P/done" ] && echo "all runs ended"
    cut -d'|' -f2,5,6,11 "$P/timed.md" 2>/dev/null
    exit 0 ;;
  *) echo "usage: commit_pairs.sh prepare SHA | start [SECONDS] | poll [SECONDS]"; exit 2 ;;
esac
