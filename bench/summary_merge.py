"""Merge the runs of several bench.compare summary.json files into one (e.g. the compare,
compare-shapes and compare-cold steps of scripts/gpu_run.sh, each its own 10-minute call).

    python -m bench.summary_merge A/summary.json B/summary.json ... -o OUT.json

Every file must come from the same commit and the same GPU (else a one-line error, exit 2,
nothing written). With --mixed-commits the commits may differ (the GPU may not): the merged file's
"commit" names every commit, the first file's first, and each run keeps its own call's commit. The
runs come in the registry's order (bench/runs.py), any other after them. A run key found in more
than one file keeps its first file's figures (said on stderr). The merged file has the summaries'
schema, its date the first file's, and "merged_from": the files, in order; every run keeps the call
it came from ("call": commit, date, command; taken from its summary where the run does not carry
it). The T4 projection is the first one with figures, checked against run gpu-bound-sm8 where the
projection's file lacks that run and another file has it (bench/t4_projection.py:
against_partition); a projection or partition prediction that needs runs of several calls (the
solution's eager host time from run shipped-graphs-off, the partition's prediction from the
shipped run) is made by bench.rebuild_report, which reads the runs' results.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import t4_projection
from bench.runs import RUNS


def merge(summaries: list[dict], names: list[str] | None = None,
          mixed_commits: bool = False) -> tuple[dict, list[str]]:
    """(merged summary, notes on run keys given twice). Raises ValueError on different GPUs, on
    different commits unless ``mixed_commits``, or on a file that is not a summary."""
    names = names or [f"summary {i + 1}" for i in range(len(summaries))]
    if not summaries:
        raise ValueError("no summary to merge")
    for name, s in zip(names, summaries):
        if not isinstance(s, dict) or not {"gpu", "date", "commit", "runs"} <= set(s):
            raise ValueError(f"{name} is not a bench.compare summary.json (want gpu, date, commit, runs)")
    first = summaries[0]
    for key in ("gpu",) if mixed_commits else ("commit", "gpu"):
        seen = {s[key] for s in summaries}
        if len(seen) > 1:
            raise ValueError(f"refusing to merge summaries of different {key}s: "
                             + ", ".join(f"{n}: {s[key]}" for n, s in zip(names, summaries)))
    runs, notes, origin = {}, [], {}
    for name, s in zip(names, summaries):
        for key, figures in s["runs"].items():
            if key in runs:
                notes.append(f"{key}: kept from {origin[key]}, also in {name}")
                continue
            call = figures.get("call") or {"commit": s["commit"], "date": s["date"], "command": s.get("command")}
            runs[key], origin[key] = {**figures, "call": call}, name
    order = {name: i for i, name in enumerate(RUNS)}
    runs = dict(sorted(runs.items(), key=lambda item: order.get(item[0], len(order))))
    # the T4 projection (bench/t4_projection.py) comes from the shipped shape's report: the first
    # summary that has one with figures (not skipped) gives it
    projections = [s.get("t4_projection") for s in summaries if isinstance(s.get("t4_projection"), dict)]
    projection = next((p for p in projections if "skipped" not in p), projections[0] if projections else None)
    if projection and not projection.get("against"):
        against = t4_projection.against_partition(projection, runs.get(t4_projection.PARTITION_RUN))
        if against:
            projection = {**projection, "against": against}
    commits = list(dict.fromkeys(s["commit"] for s in summaries))
    return {"gpu": first["gpu"], "date": first["date"], "commit": ", ".join(commits), "runs": runs,
            "t4_projection": projection, "merged_from": list(names)}, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.summary_merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="+", type=Path, help="summary.json files written by bench.compare")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the merged file to write")
    ap.add_argument("--mixed-commits", action="store_true",
                    help="merge summaries of different commits (each run keeps its call's commit)")
    args = ap.parse_args(argv)
    try:
        loaded = []
        for path in args.summaries:
            try:
                loaded.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"cannot read {path}: {exc}") from exc
        merged, notes = merge(loaded, [str(p) for p in args.summaries], args.mixed_commits)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    args.out.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(merged['runs'])} runs ({', '.join(merged['runs'])}), commit {merged['commit']}, "
          f"{merged['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
