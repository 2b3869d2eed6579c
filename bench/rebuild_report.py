"""The report of a comparison that was cut before it wrote one (a time limit, a lost machine):
rebuilt from the run folders it left, with bench.compare's own code (build_report, markdown,
summary, plot), for the run keys whose baseline and solution timed runs both finished. It
measures nothing and changes no figure; the report says that it was rebuilt and which runs were
missing.

    python -m bench.rebuild_report OUT_DIR [--machine machine.json] [--reason TEXT]

OUT_DIR: the comparison's --out folder. --machine: its GPU, versions and command (bench.compare
writes OUT_DIR/machine.json before its first run; give one by hand for a folder from before that:
{"gpu": {"name": ...}, "versions": {...}, "argv": [...], "commit": ..., "date": ISO start time}). Writes report.json,
report.md, summary.json and report.png into OUT_DIR.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from bench import compare
from bench import report as report_mod


def collect(out: Path) -> tuple[dict, list[str]]:
    """{run key: {variant or variant-profiled: result}} of the finished runs, and the missing ones."""
    runs, missing = {}, []
    for key in ("shipped", *[k for k in compare.SHAPES if k != "shipped"], compare.COLD):
        base = out if key == "shipped" else out / key
        found = {}
        for v in compare.VARIANTS:
            for name in (v, f"{v}-profiled") + ((f"{v}-{compare.EAGER_PROFILED}",) if v == "solution" else ()):
                r = compare.read_result(base / name, cold=key == compare.COLD)
                if r is not None:
                    found[name] = r
                elif name == v and base.exists():
                    missing.append(f"{key}/{name}")
        if all(v in found for v in compare.VARIANTS):
            runs[key] = found
        elif found:
            missing += [f"{key}/{n} (finished, left out: its pair did not)" for n in found]
    return runs, missing


def rebuild(out: Path, machine: dict, reason: str) -> dict:
    from workload.config import WORKLOAD_FILE, load_workload

    runs, missing = collect(out)
    if "shipped" not in runs:
        raise SystemExit(f"error: {out}: no finished baseline and solution pair of the shipped shape")
    workload = load_workload(machine.get("workload") or WORKLOAD_FILE)
    args = SimpleNamespace(argv=machine.get("argv") or [])
    ship = runs["shipped"]
    others = {key: {"data": str(compare.shape_data_path(out, key)) if key in compare.SHAPES else machine.get("data"),
                    **r} for key, r in runs.items() if key != "shipped"}
    # the comparison's machine, versions, commit and date, not this one's
    rec = {"date": machine.get("date") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "gpu": machine["gpu"], "versions": machine["versions"], "commit": machine.get("commit")}
    rep = compare.build_report(args, machine.get("model_label", "stand-in (full)"), ship["baseline"],
                               ship["solution"], ship.get("baseline-profiled"), ship.get("solution-profiled"),
                               workload, shape="shipped", data=machine.get("data"), others=others, machine=rec,
                               sol_prof_eager=ship.get(f"solution-{compare.EAGER_PROFILED}"))
    rep["rebuilt"] = {"by": "bench.rebuild_report", "reason": reason, "missing_runs": missing,
                      "rebuilt_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    note = (f"> **Rebuilt** by `bench.rebuild_report` from the run folders: {reason}. "
            f"Runs missing: {', '.join(missing) or 'none'}. No figure was measured or changed here.\n\n")
    compare.write_outputs(rep, out, note)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--machine", type=Path, help="machine.json (default OUT/machine.json)")
    ap.add_argument("--reason", default="the comparison was cut before it wrote its report")
    args = ap.parse_args(argv)
    path = args.machine or args.out / compare.MACHINE_FILE
    try:
        machine = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"error: machine file {path}: {exc}", file=sys.stderr)
        return 2
    rep = rebuild(args.out, machine, args.reason)
    print(report_mod.summary_table(rep))
    print("Rule check:")
    ok = compare.print_rows(rep["rules"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
