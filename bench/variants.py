"""Settings side by side: the solution (and optionally the baseline) under several environment
settings, each a fresh profiled process on the same GPU, in one table.

    python -m bench.variants --out DIR [--baseline] [--timed] LABEL[=VAR=VALUE[,VAR=VALUE...]] ...
    python -m bench.variants --out /tmp/v default memory=SOLUTION_MEMORY_POLICY=memory \
        eager=SOLUTION_CUDA_GRAPHS=0 bucket64=SOLUTION_GRAPH_BUCKET=64

Each label is one solution run with those variables set (a bare label: none). Every run is
profiled (GPU kernel time is what a kernel change moves; the H200's step time is host noise), so
its step time is the profiled one; --timed adds an unprofiled run per label for the step time.
Loss is compared with the first label's, step by step. Vary one thing per label against the
label it is read against.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench.compare import DEFAULT_DATA, ROOT, kernel_split, run_variant
from bench.rules import _metric_series, _rel


def parse_label(spec: str) -> tuple[str, dict[str, str]]:
    label, _, rest = spec.partition("=")
    env = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"bad setting {pair!r} in {spec!r}: want VAR=VALUE")
        env[key] = value
    if not label:
        raise ValueError(f"bad variant {spec!r}: want LABEL[=VAR=VALUE,...]")
    return label, env


def run_all(specs, out: Path, model: str, data: str, baseline: bool, timed: bool) -> list[dict]:
    rows = []
    plan = ([("baseline", {}, "baseline")] if baseline else []) + [(*parse_label(s), "solution") for s in specs]
    for label, env, variant in plan:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            prof = run_variant(variant, model, data, out / label, mode="profiled", workload=None)
            plain = run_variant(variant, model, data, out / label, mode="timed", workload=None) if timed else None
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rows.append({"label": label, "env": env, "profiled": prof, "timed": plain})
    return rows


def _gib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f}"


def table(rows: list[dict]) -> str:
    ref = rows[0]["profiled"]
    head = ("| variant | GPU s | ours s | matmul s | copy/cast s | attention s | peak alloc GiB | peak reserved GiB "
            "| step ms (median) | loss max rel diff |")
    out = [head, "| --- " + "| ---: " * 9 + "|"]
    for r in rows:
        res = r["timed"] or r["profiled"]
        split = kernel_split(r["profiled"]) or {"by_category_s": {}, "total_gpu_s": float("nan")}
        cat = split["by_category_s"]
        steps = res["step_times_s"][2:]
        a, b = _metric_series(ref, "loss"), _metric_series(r["profiled"], "loss")
        common = sorted(set(a) & set(b))
        diff = max((_rel(a[s], b[s]) for s in common), default=float("nan"))
        out.append(
            f"| {r['label']} | {split['total_gpu_s']:.3f} | {cat.get('ours (solution/ Triton)', 0):.3f} "
            f"| {cat.get('matmul (cuBLAS/CUTLASS)', 0):.3f} | {cat.get('elementwise / copy / cast', 0):.3f} "
            f"| {cat.get('attention (SDPA)', 0):.3f} | {_gib(res['peak_mem_allocated_bytes'])} "
            f"| {_gib(res['peak_mem_reserved_bytes'])} | {1000 * statistics.median(steps):.0f} | {diff:.1e} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", action="store_true", help="also a profiled baseline run, first")
    ap.add_argument("--timed", action="store_true", help="also an unprofiled run per variant, for step time")
    ap.add_argument("--model", help="model dir (default: the full-size stand-in)")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    args = ap.parse_args(argv)
    try:
        for spec in args.variants:
            parse_label(spec)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from workload.model_standin import write_standin

        model = str(ROOT / ".cache" / "models" / "qwen2.5-1.5b-instruct-standin-full")
        write_standin(model, size="full")
    rows = run_all(args.variants, args.out, model, args.data, args.baseline, args.timed)
    text = table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "variants.md").write_text(text + "\n", encoding="utf-8")
    (args.out / "variants.json").write_text(json.dumps(
        [{"label": r["label"], "env": r["env"], "split": kernel_split(r["profiled"])} for r in rows],
        indent=1, default=str), encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
