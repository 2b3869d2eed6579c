#!/usr/bin/env bash
# gpu_run.sh's steps one after another in the background on the lent GPU machine, across calls of at
# most 10 minutes each: a process in its own session (setsid) runs on between calls while the machine
# stays held (calls follow each other within its idle limit), so no stage waits for a call's turn and
# the wheels install once.
#   bash scripts/gpu_pipeline.sh start PLAN [SECONDS]  # copy the tree to $PIPE/tree, start PLAN there, then poll
#   bash scripts/gpu_pipeline.sh poll [SECONDS]        # wait until every stage ended or SECONDS (default 540)
# Each poll copies every stage that ended since the last poll into $OUT as stage-NAME.tar (its gpu_run.sh
# OUT dir and log; the device tool brings back 8 files a call) and prints a table of the stages.
# PLAN: one stage per line, NAME|VAR=VALUE ...|STEPS (gpu_run.sh's environment and steps), '#' comments:
#   ckpt|RUNS=ckpt,gpu-bound-sm16 COMPARE_ARGS="--no-profile --no-host-split" COMPARE_TIMEOUT=900|runs
# Set BENCH_COMMIT in the environment of `start` (the tree that travels has no .git).
set -uo pipefail
P=${PIPE:-/tmp/pipe}
cmd=${1:-poll}
if [ "$cmd" = start ]; then
  plan=$2; shift 2
  [ -e "$P/tree" ] && { echo "error: $P/tree exists: a pipeline already started on this machine"; exit 2; }
  mkdir -p "$P" && cp -a . "$P/tree" && cp "$plan" "$P/plan" || exit 2
  (cd "$P/tree" && setsid bash -c '
    P=$1
    while IFS="|" read -r name assign steps; do
      case $name in ""|"#"*) continue ;; esac
      date +%s > "$P/$name.start"
      eval "OUT=$P/out-$name WORK=$P/w-$name $assign bash scripts/gpu_run.sh $steps" > "$P/$name.log" 2>&1
      echo $? > "$P/$name.rc"; date +%s > "$P/$name.end"
    done < "$P/plan"
    touch "$P/all.done"' _ "$P" < /dev/null > "$P/pipeline.log" 2>&1 &)
  exec bash "$0" poll "${1:-540}"
fi
[ "$cmd" = poll ] || { echo "usage: gpu_pipeline.sh start PLAN [SECONDS] | poll [SECONDS]"; exit 2; }
[ -f "$P/plan" ] || { echo "error: no pipeline on this machine ($P/plan missing)"; exit 2; }
deadline=$((SECONDS + ${2:-540}))
OUT=${OUT:-$P/collected}; mkdir -p "$OUT"
while :; do
  for rcf in "$P"/*.rc; do
    [ -e "$rcf" ] || continue
    name=$(basename "$rcf" .rc)
    [ -e "$P/$name.copied" ] && continue
    tar cf "$OUT/stage-$name.tar" -C "$P" "out-$name" "$name.log" && touch "$P/$name.copied"
  done
  [ -e "$P/all.done" ] && break
  [ "$SECONDS" -ge "$deadline" ] && break
  sleep 5
done
now=$(date +%s)
printf '%-14s %-8s %6s %s\n' stage state secs rc
while IFS="|" read -r name _ _; do
  case $name in ""|"#"*) continue ;; esac
  s=$(cat "$P/$name.start" 2>/dev/null); e=$(cat "$P/$name.end" 2>/dev/null)
  if [ -n "$e" ]; then printf '%-14s %-8s %6s %s\n' "$name" ended $((e - s)) "$(cat "$P/$name.rc")"
  elif [ -n "$s" ]; then printf '%-14s %-8s %6s\n' "$name" running $((now - s)); tail -4 "$P/$name.log"
  else printf '%-14s %-8s\n' "$name" waiting; fi
done < "$P/plan"
[ -e "$P/all.done" ] && echo "all stages ended"
exit 0
