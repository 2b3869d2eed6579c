"""Baseline vs solution on the challenge workload, side by side, with the real Soup.

    python -m bench.compare                       # embedded default: full size on CUDA, tiny on CPU
    python -m bench.compare --model PATH --data FILE   # the real Qwen2.5-1.5B-Instruct and dataset

Runs, each in a fresh process (bench/run_one.py): baseline (timed), solution (timed), then, on a
GPU, baseline and solution again under torch.profiler (kernel time split, own-kernel share), and
once more each with the host split (bench/host_split.py: where the step's wall time goes, by
Trainer phase and decoder module). Only the timed runs give the time, memory and loss figures.
Writes runs/<timestamp>/report.{json,md,png} and prints a summary and the rule check.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import report as report_mod
from bench.own_kernels import categorize, is_own_kernel
from bench.rules import check_run, check_static, print_rows

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "workload" / "data" / "kazakh_instructions.jsonl"


class InputError(Exception):
    """Bad user input: printed as a one-line error, nothing written is lost."""


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("soup-cli", "torch", "triton", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def _gpu() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "capability": None}
    return {"name": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def resolve_inputs(args) -> tuple[str, str, str]:
    """Model dir, data file, size label. Raises InputError with a clear message."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (7, 0):
        major, minor = torch.cuda.get_device_capability()
        raise InputError(f"GPU {torch.cuda.get_device_name()} (sm_{major}{minor}) has no fast fp16 training path; "
                         "the workload is fp16 mixed precision (a T4 is sm_75)")
    size = args.size
    if size == "auto":
        size = "full" if torch.cuda.is_available() else "tiny"
    data = Path(args.data) if args.data else DEFAULT_DATA
    if not data.is_file():
        raise InputError(f"dataset not found: {data}")
    from workload.data.validate import validate_dataset

    try:
        validate_dataset(data)
    except ValueError as exc:
        raise InputError(f"dataset {data}: {exc}") from exc
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise InputError(f"model path {model} is not a Hugging Face model dir (no config.json)")
        return str(model), str(data), "user model"
    from workload.model_standin import write_standin

    cache = ROOT / ".cache" / "models" / f"qwen2.5-1.5b-instruct-standin-{size}"
    print(f"[compare] model stand-in ({size}): {cache}", flush=True)
    write_standin(cache, size=size, tokenizer_source=args.tokenizer)
    return str(cache), str(data), f"stand-in ({size})"


def _progress(log_path: Path, proc: subprocess.Popen, label: str) -> None:
    """A one-line live display of the child's step (from its progress bar in the log).
    On a terminal the line is redrawn; in a pipe a line is printed every ~15 s."""
    tty = sys.stdout.isatty()
    t0 = last_print = time.time()
    last = ""
    while proc.poll() is None:
        time.sleep(1.0)
        try:
            tail = log_path.read_bytes()[-4000:].decode("utf-8", "replace")
        except OSError:
            tail = ""
        m = re.findall(r"(\d+)/(\d+) \[", tail)
        step = f"step {m[-1][0]}/{m[-1][1]}" if m else "setting up"
        line = f"[compare] {label:<20} {step:<14} {time.time() - t0:6.0f} s"
        if tty and line != last:
            sys.stdout.write("\r" + line)
            sys.stdout.flush()
        elif not tty and step != last and time.time() - last_print > 15:
            print(line, flush=True)
            last_print = time.time()
        last = line if tty else step
    end = f"[compare] {label:<20} {'done' if proc.returncode == 0 else 'FAILED':<14} {time.time() - t0:6.0f} s"
    print(("\r" if tty else "") + end, flush=True)


def _pass_args(mode: str, work: Path) -> list[str]:
    """bench.run_one's options for a pass: none when timed; the host-split pass also logs Triton's
    compiles (both are diagnosis; neither runs in a timed pass)."""
    if mode == "profiled":
        return ["--profile"]
    if mode == "hostsplit":
        return ["--host-split", str(work / "host_split.md"), "--compile-log", str(work / "compiles.md")]
    return []


def run_variant(variant: str, model: str, data: str, out: Path, mode: str, workload: str | None) -> dict:
    """One bench.run_one child: ``mode`` "timed" (no instrument), "profiled" (torch.profiler) or
    "hostsplit" (bench/host_split.py's timers)."""
    import torch

    name = variant if mode == "timed" else f"{variant}-{mode}"
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if variant == "solution" and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # CPU: our kernels run in Triton's interpreter
    cmd = [sys.executable, "-m", "bench.run_one", "--variant", variant, "--model", model, "--data", data,
           "--workdir", str(work)] + (["--workload", workload] if workload else [])
    cmd += _pass_args(mode, work)
    log_path = work / "log.txt"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env)
        _progress(log_path, proc, name)
    res_path = work / "result.json"
    if proc.returncode != 0 or not res_path.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{name} run failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(res_path.read_text(encoding="utf-8"))
    # Soup's closing console panel is one of its outputs too (rich draws it into the log).
    result["soup_complete_panel"] = "Training Complete!" in log_path.read_text(encoding="utf-8", errors="replace")
    return result


def kernel_split(result: dict | None) -> dict | None:
    if not result or not result.get("profile"):
        return None
    times = result["profile"]["kernel_times_s"]
    cats: dict[str, float] = {}
    for name, t in times.items():
        c = categorize(name)
        cats[c] = cats.get(c, 0.0) + t
    total = sum(times.values())
    top = sorted(times.items(), key=lambda kv: -kv[1])[:15]
    return {"total_gpu_s": total, "by_category_s": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": top, "window_s": result["profile"]["window_s"]}


def build_report(args, model_label, base, sol, base_prof, sol_prof, workload, base_split=None, sol_split=None) -> dict:
    rep = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": _gpu(),
        "versions": _versions(),
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench.compare"] + (args.argv or [])),
        "model": model_label,
        "workload": {"steps": workload.steps, "examples": workload.examples, "batch_size": workload.batch_size,
                     "max_length": workload.max_length},
        "baseline": base,
        "solution": sol,
        "kernel_split": {"baseline": kernel_split(base_prof), "solution": kernel_split(sol_prof)},
        "host_split": {"baseline": (base_split or {}).get("host_split"), "solution": (sol_split or {}).get("host_split")},
        "compile_log": {"baseline": (base_split or {}).get("compile_log"), "solution": (sol_split or {}).get("compile_log")},
    }
    ran = set()
    if sol_prof and sol_prof.get("profile"):
        ran |= {k for k in sol_prof["profile"]["kernel_times_s"] if is_own_kernel(k)}
    ran |= set(sol.get("launches", {})) - set(sol.get("launches_not_ours", []))
    rep["own_kernels_ran"] = sorted(ran)
    split = rep["kernel_split"]["solution"]
    if split and sol.get("train_excl_first2_s"):
        own = split["by_category_s"].get("ours (solution/ Triton)", 0.0)
        # Own-kernel GPU time from the profiled pass over the timed pass's wall time (steps 3..N):
        # the profiler slows the host, not the kernels, so this is the honest ratio.
        rep["own_kernel_share"] = own / sol["train_excl_first2_s"]
        rep["own_kernel_share_profiled_window"] = own / split["window_s"]
        rep["own_kernel_gpu_s"] = own
    else:
        rep["own_kernel_share"] = None
        rep["own_kernel_share_note"] = (
            "not measured: no profiled pass (--no-profile)" if not sol.get("interpreter") else
            "not measured: no CUDA profiler on the CPU (kernels ran in Triton's interpreter, whose time is "
            "no GPU time)")
    rep["rules"] = check_static() + check_run(rep)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a real Qwen2.5-1.5B-Instruct dir (default: seeded random stand-in)")
    ap.add_argument("--data", help="dataset file (default: the embedded 256 Kazakh examples)")
    ap.add_argument("--tokenizer", help="tokenizer dir for the stand-in (default: built offline)")
    ap.add_argument("--size", choices=["auto", "tiny", "full"], default="auto",
                    help="stand-in size: full on CUDA, tiny on CPU (auto)")
    ap.add_argument("--workload", help="workload YAML (default workload/workload.yaml)")
    ap.add_argument("--out", type=Path, help="output dir (default runs/<timestamp>)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled passes")
    ap.add_argument("--no-host-split", action="store_true", help="skip the host-split passes")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]

    from workload.config import WORKLOAD_FILE, WorkloadConfigError, load_workload

    out = args.out or ROOT / "runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if (out / "report.json").exists():
        print(f"error: {out} already holds a report; pass another --out (nothing was overwritten)", file=sys.stderr)
        return 2
    try:
        workload = load_workload(args.workload or WORKLOAD_FILE)
        model, data, model_label = resolve_inputs(args)
    except (InputError, WorkloadConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    out.mkdir(parents=True, exist_ok=True)
    print(f"[compare] {model_label}, data {data}, output {out}", flush=True)
    base = run_variant("baseline", model, data, out, "timed", args.workload)
    sol = run_variant("solution", model, data, out, "timed", args.workload)
    base_prof = sol_prof = base_split = sol_split = None
    if torch.cuda.is_available() and not args.no_profile:
        base_prof = run_variant("baseline", model, data, out, "profiled", args.workload)
        sol_prof = run_variant("solution", model, data, out, "profiled", args.workload)
    if torch.cuda.is_available() and not args.no_host_split:
        base_split = run_variant("baseline", model, data, out, "hostsplit", args.workload)
        sol_split = run_variant("solution", model, data, out, "hostsplit", args.workload)
    rep = build_report(args, model_label, base, sol, base_prof, sol_prof, workload, base_split, sol_split)
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str), encoding="utf-8")
    md = report_mod.markdown(rep)
    (out / "report.md").write_text(md, encoding="utf-8")
    try:
        report_mod.plot(rep, out / "report.png")
    except Exception as exc:  # the plot is a convenience; never lose the report over it
        print(f"[compare] plot skipped: {exc}")
    print()
    print(report_mod.summary_table(rep))
    print("Rule check:")
    ok = print_rows(rep["rules"])
    print(f"\nReport: {out / 'report.md'} (JSON, PNG beside it)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
