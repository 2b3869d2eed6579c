"""One report from run folders: a comparison cut before it wrote its report (a time limit, a lost
machine), or the runs of several comparisons, each its own device call, assembled into one. Built
with bench.compare's own code (build_report, markdown, summary, plot) for the runs whose baseline
and solution timed passes both finished. It measures nothing and changes no figure; the report
says that it was rebuilt, which runs were missing, and which call each run came from (commit,
date, command).

    python -m bench.rebuild_report OUT_DIR [--machine machine.json] [--reason TEXT]
    python -m bench.rebuild_report DIR_A DIR_B ... --into NEW_DIR [--reason TEXT]

OUT_DIR: a comparison's --out folder. Its runs are the ones its machine.json lists (bench.compare
writes it before its first run, with every run's spec); a machine.json from before the runs were
named lists none, and then the shapes and the cold pass are looked for. --machine: the machine
file of a single folder from before machine.json ({"gpu": {"name": ...}, "versions": {...},
"argv": [...], "commit": ..., "date": ISO start time}). Several folders: every one needs its
machine.json, all of one commit and one GPU (else one line `error: ...`, exit 2); a run found in
more than one keeps its first folder's passes (said on stderr); the report goes to --into (made if
missing; it must hold no report yet). Writes report.json, report.md, summary.json and report.png.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from bench import compare, repeats
from bench import report as report_mod
from bench.runs import RUNS, RunSpec

LEGACY_RUNS = ("shipped", "long", "short", compare.COLD)  # a machine.json without "runs"


def run_specs(machine: dict) -> dict[str, RunSpec]:
    """The runs a comparison planned (machine.json's "runs"), else the registry's specs of the
    shapes and the cold pass (an older machine.json)."""
    if machine.get("runs"):
        return {name: RunSpec.from_dict(spec) for name, spec in machine["runs"].items()}
    return {name: RUNS[name] for name in LEGACY_RUNS}


def pass_names(variant: str) -> tuple[str, ...]:
    """The pass folders of a variant: timed first, then profiled, graphs-off profile, host split."""
    extra = (f"{variant}-{compare.EAGER_PROFILED}",) if variant == "solution" else ()
    return (variant, f"{variant}-profiled") + extra + (f"{variant}-hostsplit",)


def repeated_names(base: Path, variant: str) -> tuple[str, ...]:
    """The folders of a variant's repeated timed passes in a run folder (bench/repeats.py), pair 2 up."""
    names, i = [], 2
    while (base / repeats.folder(variant, i)).exists():
        names.append(repeats.folder(variant, i))
        i += 1
    return tuple(names)


def collect(out: Path, machine: dict | None = None) -> tuple[dict, list[str]]:
    """{run name: {pass name: result}} of the finished runs of the comparison in ``out`` (its
    ``machine`` record says which runs it planned), and the missing ones."""
    runs, missing = {}, []
    for key, spec in run_specs(machine or {}).items():
        base = compare.run_dir(out, key)
        found = {}
        for v in compare.VARIANTS:
            for name in pass_names(v) + repeated_names(base, v):
                r = compare.read_result(base / name, cold=spec.cold)
                if r is not None:
                    found[name] = r
                elif name == v and base.exists():
                    missing.append(f"{key}/{name}")
        if all(v in found for v in compare.VARIANTS):
            choice = repeats.apply_choice(found)  # the pair bench.compare took, from the same folders
            if choice is not None:
                found["repeats"] = choice
            runs[key] = found
        elif found:
            missing += [f"{key}/{n} (finished, left out: its pair did not)" for n in found]
    return runs, missing


def _same(machines: list[dict], names: list[str]) -> None:
    """Refuse folders of different commits or GPUs (ValueError, one line)."""
    for field, get in (("commit", lambda m: m.get("commit")), ("GPU", lambda m: (m.get("gpu") or {}).get("name"))):
        seen = {get(m) for m in machines}
        if len(seen) > 1:
            raise ValueError(f"refusing to assemble runs of different {field}s: "
                             + ", ".join(f"{n}: {get(m)}" for n, m in zip(names, machines)))


def rebuild(outs, machines, reason: str, into: Path | None = None) -> dict:
    """The report of the finished runs in ``outs`` (a folder or a list of them; ``machines``: the
    machine record of each, same order), written into ``into`` (default: the one folder). Raises
    ValueError (one line) for folders of different commits or GPUs, SystemExit when no run finished."""
    from workload.config import WORKLOAD_FILE, load_workload

    outs = [outs] if isinstance(outs, (str, Path)) else list(outs)
    machines = [machines] if isinstance(machines, dict) else list(machines)
    outs = [Path(o) for o in outs]
    into = Path(into) if into is not None else outs[0]
    _same(machines, [str(o) for o in outs])
    every, specs, missing, notes = {}, {}, [], []
    for out, machine in zip(outs, machines):
        found, gone = collect(out, machine)
        call = compare.call_of(machine)
        where = f"{out}: " if len(outs) > 1 else ""
        missing += [where + m for m in gone]
        plan = run_specs(machine)
        for key, passes in found.items():
            if key in every:
                notes.append(f"{key}: kept from {every[key]['folder']}, also in {out}")
                continue
            spec = plan[key]
            data = machine.get("data") if spec.shape == "shipped" else str(compare.shape_data_path(out, spec.shape))
            every[key] = {"data": data, "call": call, "folder": str(out), **passes}
            specs[key] = spec
    if not every:
        raise SystemExit(f"error: {', '.join(map(str, outs))}: no finished baseline and solution pair")
    first = machines[0]
    workload = load_workload(first.get("workload") or WORKLOAD_FILE)
    primary = "shipped" if "shipped" in every else next(iter(every))
    p = every[primary]
    others = {key: runs for key, runs in every.items() if key != primary}
    # the first comparison's machine, versions, commit and date, not this one's
    rec = {"date": first.get("date") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "gpu": first["gpu"], "versions": first["versions"], "commit": first.get("commit")}
    rep = compare.build_report(SimpleNamespace(argv=first.get("argv") or []), first.get("model_label", "stand-in (full)"),
                               p["baseline"], p["solution"], p.get("baseline-profiled"), p.get("solution-profiled"),
                               workload, p.get("baseline-hostsplit"), p.get("solution-hostsplit"), shape=primary,
                               data=p["data"], others=others, machine=rec,
                               sol_prof_eager=p.get(f"solution-{compare.EAGER_PROFILED}"), specs=specs,
                               repeated={k: r["repeats"] for k, r in every.items() if r.get("repeats")})
    rep["shapes"][primary]["call"] = p["call"]
    rep["rebuilt"] = {"by": "bench.rebuild_report", "reason": reason, "missing_runs": missing,
                      "folders": [str(o) for o in outs], "duplicates": notes,
                      "rebuilt_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    source = "the run folders" if len(outs) == 1 else f"the run folders of {len(outs)} comparisons"
    note = (f"> **Rebuilt** by `bench.rebuild_report` from {source}: {reason}. "
            f"Runs missing: {', '.join(missing) or 'none'}. No figure was measured or changed here; the table "
            "\"Runs and the calls they came from\" says which call each run came from.\n\n")
    into.mkdir(parents=True, exist_ok=True)
    compare.write_outputs(rep, into, note)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rebuild_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="+", help="comparison --out folders (one or several)")
    ap.add_argument("--machine", type=Path, help="machine.json (default OUT/machine.json; one folder only)")
    ap.add_argument("--into", type=Path, help="where the report goes (default: the one folder; required with "
                    "several)")
    ap.add_argument("--reason", default=None, help="why the report was rebuilt (said in its header)")
    args = ap.parse_args(argv)
    several = len(args.out) > 1
    if several and args.machine:
        print("error: --machine is for one folder; several folders each need their machine.json", file=sys.stderr)
        return 2
    if several and not args.into:
        print("error: several folders: give --into NEW_DIR for the assembled report", file=sys.stderr)
        return 2
    if args.into and (args.into / "report.json").exists() and (several or args.into != args.out[0]):
        print(f"error: {args.into} already holds a report; pass another --into (nothing was overwritten)",
              file=sys.stderr)
        return 2
    machines = []
    for out in args.out:
        path = args.machine or out / compare.MACHINE_FILE
        try:
            machines.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            print(f"error: machine file {path}: {exc}", file=sys.stderr)
            return 2
    reason = args.reason or ("the runs of several comparisons, one report" if several
                             else "the comparison was cut before it wrote its report")
    try:
        rep = rebuild(args.out, machines, reason, args.into)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report_mod.summary_table(rep))
    print("Rule check:")
    ok = compare.print_rows(rep["rules"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
