#!/usr/bin/env bash
# Writes an older commit's solution/, bench/ and workload/ (and its id, COMMIT) into $OLD_DIR (default
# .cache/old), so that gpu_run.sh's timed step runs its "old*" labels from that tree (TIMED_OLD_TREE) beside
# this tree's, on ONE machine: whether a host-bound ratio moved with the code or with the host.
#   here:    bash scripts/commit_pairs.sh SHA
#   device:  bash scripts/gpu_pipeline.sh start scripts/commit_pairs.plan   (run tool carry: [".whl", ".cache/old"])
#            bash scripts/gpu_pipeline.sh poll                              (later calls; one stage a round)
set -uo pipefail
cd "$(dirname "$0")/.."
OLD_DIR=${OLD_DIR:-.cache/old}
sha=${1:-}
git rev-parse -q --verify "${sha:-none}^{commit}" >/dev/null 2>&1 \
  || { echo "error: give a commit of this repository (got '${sha}')"; exit 2; }
rm -rf "$OLD_DIR" && mkdir -p "$OLD_DIR" \
  && git archive "$sha" solution bench workload pyproject.toml | tar -x -C "$OLD_DIR" \
  && git rev-parse "$sha" > "$OLD_DIR/COMMIT" || { echo "error: could not write $OLD_DIR"; exit 2; }
echo "$OLD_DIR: $(cat "$OLD_DIR/COMMIT") ($(du -sh "$OLD_DIR" | cut -f1))"
