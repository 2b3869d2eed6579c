"""The challenge's rule checks, as their own command and inside the report.

    python -m bench.rules [--report runs/<dir>/report.json]

Static checks (always): no prohibited package imported by solution/ or declared by the project;
no torch.compile / dynamo / inductor in solution/; at least one @triton.jit kernel in solution/.
Run checks (with --report): a solution/ kernel executed during training; own-kernel share of
training time (excluding the first two steps) >= 5%; Soup's outputs and tracker rows present and
well-formed; and, against the baseline: every value the Trainer logged at every step (the loss
curve, grad norm, entropy and token accuracy within TOL; learning rate, epoch and tokens per step
equal: batch composition and order unchanged; any other logged key within TOL too), the closing
log row, the fp16 GradScaler's skipped steps and scale after each step (equal), and Soup's
rewind.jsonl row by row. A report's other runs (bench.compare --shapes / --cold, ...) get the same
comparisons. The tolerances, with the observed figures they come from: docs/tolerances.md.
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

# Tolerances for solution vs baseline on identical inputs, each about 10x the worst difference
# observed between them on any dataset shape (docs/tolerances.md: the figures, their sources, and
# why two runs differ at all: fp16 rounding of fused against unfused code, and PyTorch's
# memory-efficient attention backward, which sums with atomics in a varying order).
TOL = {
    "loss_max_rel": 1e-3,          # every step's loss within 0.1% of the baseline's
    "loss_mean_rel": 2e-4,         # and within 0.02% on average over the steps
    "entropy_max_rel": 1e-3,
    "accuracy_max_abs": 0.01,      # mean token accuracy: an absolute fraction of the tokens
    "grad_norm_median_rel": 5e-3,
    "rewind_loss_max_rel": 1e-3,   # rewind.jsonl's per-row losses, row by row
    "other_max_rel": 1e-3,         # a logged value not named below (e.g. the final train_loss)
}

# The per-step values the Trainer logs: transformers' loss, grad_norm, learning_rate and epoch,
# trl's SFTTrainer's entropy, num_tokens and mean_token_accuracy. How each is compared with the
# baseline's: "exact" (it depends on the data, the schedule and the skipped steps only, never on
# rounding), or (statistic, tolerance) over the steps: max_rel, mean_rel, median_rel (relative
# differences), max_abs (absolute). A logged key not listed here is compared as OTHER.
STEP_METRICS = {
    "loss": (("max_rel", TOL["loss_max_rel"]), ("mean_rel", TOL["loss_mean_rel"])),
    "grad_norm": (("median_rel", TOL["grad_norm_median_rel"]),),
    "entropy": (("max_rel", TOL["entropy_max_rel"]),),
    "mean_token_accuracy": (("max_abs", TOL["accuracy_max_abs"]),),
    "learning_rate": "exact",
    "epoch": "exact",
    "num_tokens": "exact",
    "num_input_tokens_seen": "exact",
}
OTHER = (("max_rel", TOL["other_max_rel"]),)
# The Trainer's closing log row (it carries train_runtime): its timings differ by design and are
# not compared; its other values are (train_loss as OTHER, total_flos and epoch exactly).
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
FINAL_EXACT = ("total_flos", "epoch")
# rewind.jsonl's header keys that differ between any two runs (a wall-clock timestamp).
REWIND_VOLATILE = ("created",)


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


def _is_final(log: dict) -> bool:
    """The Trainer's closing log row (train_runtime, train_loss, ...), not a step's."""
    return "train_runtime" in log


def _metric_series(result: dict, key: str) -> dict[int, float]:
    """{step: value} of one logged key over the training steps (the closing row left out); a
    value that is not a number is left out too."""
    out = {}
    for log in result.get("trainer_logs", []):
        if key in log and not _is_final(log):
            try:
                out[int(log["step"])] = float(log[key])
            except (TypeError, ValueError):
                pass
    return out


def _step_keys(result: dict) -> set[str]:
    """Every key the run logged at some training step (the closing row left out)."""
    return {k for log in result.get("trainer_logs", []) if not _is_final(log) for k in log} - {"step"}


def _final_log(result: dict) -> dict:
    return next((log for log in result.get("trainer_logs", []) if _is_final(log)), {})


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def series_diff(base: dict, sol: dict, key: str, absolute: bool = False) -> dict:
    """The solution's logged ``key`` against the baseline's, step by step: the steps both logged
    ("steps"), whether both logged the same steps ("same_steps"), whether the solution is
    non-finite (inf / NaN) exactly where the baseline is ("same_nonfinite", with those steps in
    "nonfinite"), and the max, mean and median of the relative (``absolute``: absolute)
    differences at the steps where both are finite (inf when no step is in common; 0 when every
    common step is non-finite in both)."""
    b, s = _metric_series(base, key), _metric_series(sol, key)
    common = sorted(set(b) & set(s))
    bad = [t for t in common if not (math.isfinite(b[t]) and math.isfinite(s[t]))]
    diffs = sorted(abs(s[t] - b[t]) if absolute else _rel(s[t], b[t]) for t in common if t not in bad)
    if not diffs:
        diffs = [0.0] if common else [float("inf")]
    return {"steps": len(common), "same_steps": bool(common) and set(b) == set(s),
            "same_nonfinite": all(math.isfinite(b[t]) == math.isfinite(s[t]) for t in common),
            "nonfinite": bad, "max": diffs[-1], "mean": sum(diffs) / len(diffs), "median": diffs[len(diffs) // 2]}


def loss_diffs(base: dict, sol: dict) -> dict:
    """The solution's logged loss against the baseline's, step by step (series_diff): the steps both
    logged, whether they logged the same steps, whether the solution is non-finite exactly where the
    baseline is, and the max and mean relative difference over the finite steps (inf when none)."""
    d = series_diff(base, sol, "loss")
    return {"steps": d["steps"], "same_steps": d["same_steps"], "same_nonfinite": d["same_nonfinite"],
            "nonfinite": d["nonfinite"], "max_rel": d["max"], "mean_rel": d["mean"]}


def _nonfinite_note(d: dict) -> str:
    if not d["nonfinite"]:
        return ""
    return f"; non-finite at steps {_steps_text(d['nonfinite'])}" + ("" if d["same_nonfinite"] else " (not both)")


def loss_row(base: dict, sol: dict) -> dict:
    d = loss_diffs(base, sol)
    return {"check": f"loss curve within tolerance (max rel <= {TOL['loss_max_rel']}, mean rel <= {TOL['loss_mean_rel']})",
            "ok": d["same_steps"] and d["same_nonfinite"] and d["max_rel"] <= TOL["loss_max_rel"]
            and d["mean_rel"] <= TOL["loss_mean_rel"],
            "figure": f"{d['steps']} steps, max rel diff {d['max_rel']:.2e}, mean rel diff {d['mean_rel']:.2e}"
            + _nonfinite_note(d)}


def _tolerance_text(rule) -> str:
    return "equal at every step" if rule == "exact" else ", ".join(
        f"{stat.replace('_', ' ')} <= {tol:g}" for stat, tol in rule)


def metric_row(base: dict, sol: dict, key: str, rule) -> dict:
    """One logged per-step metric of the solution against the baseline's, by ``rule`` (an entry of
    STEP_METRICS): logged at the same steps, non-finite at the same steps, and within tolerance
    (or equal) at the others."""
    b, s = _metric_series(base, key), _metric_series(sol, key)
    check = f"logged metric {key} ({_tolerance_text(rule)})"
    if rule == "exact":
        diff = [t for t in sorted(set(b) | set(s)) if b.get(t) != s.get(t) and not
                (t in b and t in s and math.isnan(b[t]) and math.isnan(s[t]))]
        return {"check": check, "ok": bool(b) and not diff,
                "figure": f"{len(set(b) & set(s))} steps" + (
                    f"; differs at steps {_steps_text(diff)} (first: {b.get(diff[0])} vs {s.get(diff[0])})"
                    if diff else ", all equal")}
    absolute = any(stat.endswith("_abs") for stat, _ in rule)
    d = series_diff(base, sol, key, absolute=absolute)
    within = all(d[stat.split("_")[0]] <= tol for stat, tol in rule)
    figure = f"{d['steps']} steps, " + ", ".join(f"{stat.replace('_', ' ')} diff {d[stat.split('_')[0]]:.2e}"
                                                  for stat, _ in rule)
    if "max" not in {stat.split("_")[0] for stat, _ in rule}:
        figure += f" (max {d['max']:.2e})"
    return {"check": check, "ok": d["same_steps"] and d["same_nonfinite"] and within,
            "figure": figure + _nonfinite_note(d)}


def _steps_text(steps: list) -> str:
    steps = list(steps)
    return ", ".join(map(str, steps[:8])) + (f", ... ({len(steps)} steps)" if len(steps) > 8 else "")


def compare_metrics(base: dict, sol: dict) -> list[dict]:
    """Every value the Trainer logged, step by step, against the baseline's: the loss curve, then each
    metric of STEP_METRICS the baseline logged, then any other logged key (OTHER's tolerance), then the
    closing log row, then the batch check (same steps, same tokens per step). Both runs must log the same
    keys."""
    rows = [loss_row(base, sol)]
    keys_b, keys_s = _step_keys(base), _step_keys(sol)
    for key, rule in STEP_METRICS.items():
        if key != "loss" and key in keys_b | keys_s:
            rows.append(metric_row(base, sol, key, rule))
    for key in sorted((keys_b | keys_s) - set(STEP_METRICS)):
        rows.append(metric_row(base, sol, key, OTHER))
    if keys_b != keys_s:
        rows.append({"check": "the solution logs the baseline's metrics", "ok": False,
                     "figure": "; ".join(f"only the {v} logs {', '.join(sorted(ks))}" for v, ks in
                                         (("baseline", keys_b - keys_s), ("solution", keys_s - keys_b)) if ks)})
    final = final_row(base, sol)
    if final is not None:
        rows.append(final)
    tb, ts = _metric_series(base, "num_tokens"), _metric_series(sol, "num_tokens")
    rows.append({"check": "same steps and same tokens per step as the baseline (batch order unchanged)",
                 "ok": base.get("steps") == sol.get("steps") and tb == ts and bool(tb),
                 "figure": f"steps {base.get('steps')} vs {sol.get('steps')}; tokens {tb.get(max(tb)) if tb else None} vs {ts.get(max(ts)) if ts else None}"})
    return rows


def final_row(base: dict, sol: dict) -> dict | None:
    """The Trainer's closing log row against the baseline's (None when neither run has one):
    FINAL_EXACT keys equal, the timings (TIMINGS) left out, every other value within OTHER's
    tolerance (train_loss: the mean of the step losses)."""
    fb, fs = _final_log(base), _final_log(sol)
    if not fb and not fs:
        return None
    problems = []
    for key in sorted((set(fb) | set(fs)) - set(TIMINGS) - {"step"}):
        a, b = fs.get(key), fb.get(key)
        if key not in fb or key not in fs:
            problems.append(f"{key} logged by the {'baseline' if key in fb else 'solution'} only")
        elif key in FINAL_EXACT:
            if a != b:
                problems.append(f"{key} {a} vs {b}")
        elif not (_finite(a) and _finite(b)) or _rel(a, b) > TOL["other_max_rel"]:
            problems.append(f"{key} {a} vs {b}")
    return {"check": f"closing log row ({', '.join(FINAL_EXACT)} equal, other values max rel <= "
                     f"{TOL['other_max_rel']:g}; timings not compared)",
            "ok": not problems,
            "figure": "; ".join(problems) or f"train_loss {fs.get('train_loss')} vs {fb.get('train_loss')}"}


def scaler_row(base: dict, sol: dict) -> dict:
    """The fp16 GradScaler's decisions (bench.run_one's skipped_steps and scaler_scales): the same
    optimizer steps skipped and the same loss scale after every step as the baseline. A run without a
    GradScaler (fp32 or bf16 training) records no scales and skips nothing."""
    check = "GradScaler: the same skipped optimizer steps and the same scale after each step"
    sb, ss = base.get("skipped_steps"), sol.get("skipped_steps")
    cb, cs = base.get("scaler_scales"), sol.get("scaler_scales")
    if sb is None or ss is None:
        who = " and ".join(v for v, r in (("baseline", sb), ("solution", ss)) if r is None)
        return {"check": check, "ok": False, "figure": f"not recorded by the {who} (a result.json from before "
                                                         "bench.run_one recorded skipped_steps)"}
    if cb != cs:
        cb_, cs_ = cb or [], cs or []
        first = next((i for i, (x, y) in enumerate(zip(cb_, cs_)) if x != y), min(len(cb_), len(cs_)))
        scales = (f"scales differ from step {first + 1}: {cb_[first] if first < len(cb_) else None} vs "
                  f"{cs_[first] if first < len(cs_) else None}")
    else:
        scales = ("no GradScaler (not fp16 training)" if cb is None else
                  f"scale after the last step {cb[-1] if cb else None} in both")
    skipped = (f"skipped steps {_steps_text(sb) or 'none'}" if sb == ss else
               f"skipped steps {_steps_text(sb) or 'none'} vs {_steps_text(ss) or 'none'}")
    return {"check": check, "ok": sb == ss and cb == cs, "figure": f"{skipped}; {scales}"}


def rewind_row(base: dict, sol: dict) -> dict:
    """Soup's rewind.jsonl (bench.run_one's outputs.rewind) against the baseline's, row by row: the
    header equal (but REWIND_VOLATILE), every batch row's step, micro, dataset rows and token counts
    equal, its per-row losses non-finite (null) at the same places and within rewind_loss_max_rel."""
    tol = TOL["rewind_loss_max_rel"]
    check = f"rewind.jsonl row by row (rows, tokens equal; per-row loss max rel <= {tol:g})"
    rb, rs = (r.get("outputs", {}).get("rewind") for r in (base, sol))
    if rb is None or rs is None:
        return {"check": check, "ok": False, "figure": "values not recorded (a result.json from before bench.run_one "
                                                        "read rewind.jsonl's values)"}
    problems, worst, losses = [], 0.0, 0
    if len(rb) != len(rs):
        problems.append(f"{len(rs)} rows, the baseline's {len(rb)}")
    for i, (a, b) in enumerate(zip(rs, rb)):
        if a.get("kind") == "header" or b.get("kind") == "header":
            strip = lambda h: {k: v for k, v in h.items() if k not in REWIND_VOLATILE}  # noqa: E731
            if strip(a) != strip(b):
                problems.append(f"row {i + 1}: header differs")
            continue
        same = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k != "row_loss"}
        diff = sorted(k for k, (x, y) in same.items() if x != y)
        if diff:
            problems.append(f"row {i + 1} (step {b.get('step')}): {', '.join(diff)} differ")
        la, lb = a.get("row_loss") or [], b.get("row_loss") or []
        if len(la) != len(lb) or any((x is None) != (y is None) for x, y in zip(la, lb)):
            problems.append(f"row {i + 1} (step {b.get('step')}): row losses non-finite at other places")
            continue
        for x, y in zip(la, lb):
            if x is not None:
                losses += 1
                worst = max(worst, _rel(x, y))
    if worst > tol:
        problems.append(f"per-row loss max rel diff {worst:.2e}")
    return {"check": check, "ok": not problems,
            "figure": "; ".join(problems[:4]) + (f"; ... ({len(problems)} problems)" if len(problems) > 4 else "")
            or f"{len(rs)} rows, {losses} row losses, max rel diff {worst:.2e}"}


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


def other_run_rows(key: str, base: dict, sol: dict) -> list[dict]:
    """The rows of one other run of a report (a dataset shape, the cold pass, ...): its loss curve
    and its GradScaler steps, each a row; every other comparison (compare_metrics' other rows and
    rewind.jsonl) in one row that names what failed."""
    rest = compare_metrics(base, sol)[1:] + [rewind_row(base, sol)]
    failed = [r for r in rest if not r["ok"]]
    return [{**row, "check": f"{key}: {row['check']}"} for row in (loss_row(base, sol), scaler_row(base, sol))] + [
        {"check": f"{key}: every other logged metric and rewind.jsonl as the baseline's", "ok": not failed,
         "figure": "; ".join(f"{r['check']}: {r['figure']}" for r in failed) or f"{len(rest)} checks pass"}]


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
    rows += [scaler_row(base, sol), rewind_row(base, sol)]
    # The other runs of the report (dataset shapes, the cold pass, ...): the same comparisons.
    for key, runs in (report.get("shape_runs") or {}).items():
        rows += other_run_rows(key, runs["baseline"], runs["solution"])
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
    ap = argparse.ArgumentParser(prog="python -m bench.rules", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
