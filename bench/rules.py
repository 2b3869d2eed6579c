"""The challenge's rule checks, as their own command and inside the report.

    python -m bench.rules [--report runs/<dir>/report.json]

Static checks (always): no prohibited package imported by solution/ or declared by the
project; no torch.compile / dynamo / inductor in solution/; at least one @triton.jit kernel in
solution/. Run checks (with --report): a solution/ kernel executed during training; own-kernel
share of training time (excluding the first two steps) >= 5%; same steps and the same tokens
per step as the baseline (batch composition and order unchanged); loss curve and metrics within
tolerance; Soup's outputs and tracker rows present and well-formed; in a report with other
dataset shapes or a cold pass (bench.compare --shapes / --cold), each of those runs' loss curve
within the same tolerance.
Each check prints PASS/FAIL with its figure. Exit status: 0 every check passed, 1 a check failed,
2 bad input (a report that is missing, unreadable, not JSON or not a whole report.json of
bench.compare), said in one line `error: ...` on stderr.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from pathlib import Path

from bench.own_kernels import SOLUTION_DIR, own_kernel_names

ROOT = SOLUTION_DIR.parent
PROHIBITED = ("unsloth", "liger_kernel", "flash_attn", "xformers", "torchao", "cut_cross_entropy")
PROHIBITED_DISTS = ("unsloth", "liger-kernel", "liger_kernel", "flash-attn", "flash_attn", "xformers", "torchao",
                    "cut-cross-entropy", "cut_cross_entropy")
COMPILE_NAMES = ("torch.compile", "torch._dynamo", "torch._inductor", "_dynamo", "_inductor")
MIN_OWN_SHARE = 0.05

# Tolerances for solution vs baseline on identical inputs (justified in docs/PERFORMANCE.md):
# fp16 rounding differs between fused and unfused code, and the difference compounds over
# 64 optimizer steps, so per-step values are compared with relative tolerances.
TOL = {
    "loss_max_rel": 0.01,          # every step's loss within 1% of the baseline's
    "loss_mean_rel": 0.002,        # and within 0.2% on average
    "entropy_max_rel": 0.01,
    "accuracy_max_abs": 0.02,
    "grad_norm_median_rel": 0.05,
}


def _py_files():
    return sorted(p for p in SOLUTION_DIR.rglob("*.py"))


def check_static() -> list[dict]:
    rows = []
    bad_imports, compile_uses = [], []
    for path in _py_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                if m.split(".")[0] in PROHIBITED:
                    bad_imports.append(f"{path.relative_to(ROOT)}: import {m}")
                if m.startswith(("torch._dynamo", "torch._inductor")):
                    compile_uses.append(f"{path.relative_to(ROOT)}: import {m}")
            if isinstance(node, ast.Attribute):
                text = ast.unparse(node)
                if text in ("torch.compile",) or text.startswith(("torch._dynamo", "torch._inductor")):
                    compile_uses.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.split(".")[0] in PROHIBITED and node.value in PROHIBITED:
                    bad_imports.append(f"{path.relative_to(ROOT)}:{node.lineno}: string {node.value!r}")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8").lower()
    declared = [d for d in PROHIBITED_DISTS if f'"{d}' in pyproject]
    rows.append({"check": "no prohibited package imported by solution/ or declared by the project",
                 "ok": not bad_imports and not declared,
                 "figure": "; ".join(bad_imports + declared) or f"none of {', '.join(PROHIBITED)}"})
    rows.append({"check": "no torch.compile / dynamo / inductor in solution/", "ok": not compile_uses,
                 "figure": "; ".join(compile_uses) or "none"})
    names = sorted(own_kernel_names())
    rows.append({"check": "solution/ holds original @triton.jit kernels", "ok": bool(names),
                 "figure": f"{len(names)} kernels: {', '.join(names)}"})
    return rows


def _metric_series(result: dict, key: str) -> dict[int, float]:
    out = {}
    for log in result.get("trainer_logs", []):
        if key in log and "train_runtime" not in log:
            try:
                out[int(log["step"])] = float(log[key])
            except (TypeError, ValueError):
                pass
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def loss_diffs(base: dict, sol: dict) -> dict:
    """The solution's logged loss against the baseline's, step by step: the steps both logged,
    whether they logged the same steps, whether the solution's losses are finite, and the max and
    mean relative difference (inf when no step is in common)."""
    lb, ls = _metric_series(base, "loss"), _metric_series(sol, "loss")
    common = sorted(set(lb) & set(ls))
    rels = [_rel(ls[s], lb[s]) for s in common]
    return {"steps": len(common), "same_steps": bool(common) and set(lb) == set(ls),
            "finite": all(math.isfinite(ls[s]) for s in common),
            "max_rel": max(rels) if rels else float("inf"),
            "mean_rel": sum(rels) / len(rels) if rels else float("inf")}


def loss_row(base: dict, sol: dict) -> dict:
    d = loss_diffs(base, sol)
    return {"check": f"loss curve within tolerance (max rel <= {TOL['loss_max_rel']}, mean rel <= {TOL['loss_mean_rel']})",
            "ok": d["same_steps"] and d["finite"] and d["max_rel"] <= TOL["loss_max_rel"]
            and d["mean_rel"] <= TOL["loss_mean_rel"],
            "figure": f"{d['steps']} steps, max rel diff {d['max_rel']:.2e}, mean rel diff {d['mean_rel']:.2e}"}


def compare_metrics(base: dict, sol: dict) -> list[dict]:
    rows = [loss_row(base, sol)]
    for key, tol, kind in (("entropy", TOL["entropy_max_rel"], "rel"),
                           ("mean_token_accuracy", TOL["accuracy_max_abs"], "abs")):
        a, b = _metric_series(sol, key), _metric_series(base, key)
        cs = sorted(set(a) & set(b))
        if not b:
            continue
        diffs = [(_rel(a[s], b[s]) if kind == "rel" else abs(a[s] - b[s])) for s in cs]
        worst = max(diffs) if diffs else float("inf")
        rows.append({"check": f"trl metric {key} logged and within tolerance (max {kind} <= {tol})",
                     "ok": bool(cs) and set(a) == set(b) and worst <= tol,
                     "figure": f"{len(cs)} steps, max {kind} diff {worst:.2e}"})
    gb, gs = _metric_series(base, "grad_norm"), _metric_series(sol, "grad_norm")
    cs = sorted(set(gb) & set(gs))
    if cs:
        rels = sorted(_rel(gs[s], gb[s]) for s in cs)
        med = rels[len(rels) // 2]
        rows.append({"check": f"grad_norm within tolerance (median rel <= {TOL['grad_norm_median_rel']})",
                     "ok": med <= TOL["grad_norm_median_rel"] and set(gb) == set(gs),
                     "figure": f"median rel diff {med:.2e}, max {rels[-1]:.2e}"})
    tb, ts = _metric_series(base, "num_tokens"), _metric_series(sol, "num_tokens")
    rows.append({"check": "same steps and same tokens per step as the baseline (batch order unchanged)",
                 "ok": base.get("steps") == sol.get("steps") and tb == ts and bool(tb),
                 "figure": f"steps {base.get('steps')} vs {sol.get('steps')}; tokens {tb.get(max(tb)) if tb else None} vs {ts.get(max(ts)) if ts else None}"})
    return rows


def check_outputs(result: dict, expected_steps: int, base: dict | None) -> dict:
    tr = result.get("tracker", {})
    runs = tr.get("runs", [])
    metrics = tr.get("metrics", [])
    problems = []
    if result.get("rc") != 0:
        problems.append(f"soup exit code {result.get('rc')}")
    if len(runs) != 1:
        problems.append(f"{len(runs)} tracker runs")
    else:
        run = runs[0]
        if run.get("status") != "completed":
            problems.append(f"run status {run.get('status')}")
        if run.get("total_steps") != expected_steps:
            problems.append(f"total_steps {run.get('total_steps')} != {expected_steps}")
        for key in ("initial_loss", "final_loss", "duration_secs"):
            v = run.get(key)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                problems.append(f"{key}={v}")
    step_rows = {m["step"] for m in metrics if m.get("loss") is not None}
    if step_rows != set(range(1, expected_steps + 1)):
        problems.append(f"tracker metrics cover {len(step_rows)} of {expected_steps} steps")
    if result.get("soup_complete_panel") is False:
        problems.append("Soup's 'Training Complete!' panel was not printed")
    outs = result.get("outputs", {})
    missing = [k for k, v in outs.get("present", {}).items() if not v]
    if missing:
        problems.append("missing outputs: " + ", ".join(missing))
    if base is not None:
        base_outs = base.get("outputs", {})
        if outs.get("adapter_keys") != base_outs.get("adapter_keys"):
            problems.append("adapter key names differ from the baseline's")
        if outs.get("rewind_rows") != base_outs.get("rewind_rows"):
            problems.append(f"rewind.jsonl has {outs.get('rewind_rows')} rows, the baseline's "
                            f"{base_outs.get('rewind_rows')}")
    return {"check": f"{result.get('variant')}: Soup outputs and tracker rows present and well-formed",
            "ok": not problems, "figure": "; ".join(problems) or
            f"run completed, {len(step_rows)} metric rows, {len(outs.get('adapter_keys', []))} adapter tensors, "
            f"{outs.get('rewind_rows')} rewind rows"}


def check_run(report: dict) -> list[dict]:
    base, sol = report["baseline"], report["solution"]
    steps = report["workload"]["steps"]
    rows = [check_outputs(base, steps, None), check_outputs(sol, steps, base)]
    ran = report.get("own_kernels_ran", [])
    rows.append({"check": "a solution/ @triton.jit kernel executed during training", "ok": bool(ran),
                 "figure": ", ".join(ran) or "none"})
    share = report.get("own_kernel_share")
    if share is None:
        rows.append({"check": f"own-kernel share of training time (excl. first 2 steps) >= {MIN_OWN_SHARE:.0%}",
                     "ok": None, "figure": report.get("own_kernel_share_note", "not measured (no GPU profiler)")})
    else:
        rows.append({"check": f"own-kernel share of training time (excl. first 2 steps) >= {MIN_OWN_SHARE:.0%}",
                     "ok": share >= MIN_OWN_SHARE, "figure": f"{share:.1%}"})
    leaked = sol.get("prohibited_modules_loaded") or []
    rows.append({"check": "no prohibited module loaded in the solution run", "ok": not leaked,
                 "figure": ", ".join(leaked) or "none"})
    rows += compare_metrics(base, sol)
    # The other runs of the report (dataset shapes, the cold pass): the same loss tolerance.
    for key, runs in (report.get("shape_runs") or {}).items():
        row = loss_row(runs["baseline"], runs["solution"])
        rows.append({**row, "check": f"{key}: {row['check']}"})
    return rows


def print_rows(rows: list[dict]) -> bool:
    ok_all = True
    for r in rows:
        status = "PASS" if r["ok"] else ("n/a " if r["ok"] is None else "FAIL")
        if r["ok"] is False:
            ok_all = False
        print(f"  [{status}] {r['check']}: {r['figure']}")
    return ok_all


RUN_KEYS = ("steps", "trainer_logs")  # keys of a bench.run_one result that a report's runs must have


class ReportError(ValueError):
    """A report file that cannot be judged: missing, unreadable, not JSON, or incomplete."""


def load_report(path: Path) -> dict:
    """A report.json of bench.compare, read and checked for what the rules and the renderer need
    (the workload's steps, a baseline and a solution run). Raises ReportError (one line)."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"report not found: {path}")
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"cannot read report {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ReportError(f"report {path} is not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ReportError(f"report {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                          "a file cut short?") from exc
    if not isinstance(rep, dict):
        raise ReportError(f"report {path} is not a report.json of bench.compare (a JSON {type(rep).__name__})")
    if "runs" in rep and "baseline" not in rep:
        raise ReportError(f"{path} is a summary.json (bench.summary_merge's input), not a report.json of bench.compare")
    for key in ("workload", "baseline", "solution"):
        if not isinstance(rep.get(key), dict):
            raise ReportError(f"report {path} is incomplete: no {key!r} object (not a report.json of bench.compare?)")
    for variant in ("baseline", "solution"):  # what every bench.run_one result holds
        missing = [key for key in RUN_KEYS if key not in rep[variant]]
        if missing:
            raise ReportError(f"report {path} is incomplete: its {variant} run has no {missing[0]!r}")
    steps = rep["workload"].get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ReportError(f"report {path} is incomplete: workload.steps is {steps!r}, not a number of steps")
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, help="report.json written by bench.compare")
    args = ap.parse_args(argv)
    rows = check_static()
    if args.report:
        try:
            rep = load_report(args.report)
            rows += check_run(rep)
        except ReportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:  # a part of it malformed
            print(f"error: report {args.report} is incomplete or malformed ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
    print("Rule check:")
    return 0 if print_rows(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
