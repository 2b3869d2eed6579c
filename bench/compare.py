"""Baseline vs solution on the challenge workload, side by side, with the real Soup.

    python -m bench.compare                       # embedded default: full size on CUDA, tiny on CPU
    python -m bench.compare --model PATH --data FILE   # the real Qwen2.5-1.5B-Instruct and dataset

Every pass runs in a fresh process (bench/run_one.py): baseline (timed), solution (timed), then,
on a GPU, baseline and solution again under torch.profiler (kernel time split, own-kernel share),
and once more each with the host split (bench/host_split.py: where the step's wall time goes, by
Trainer phase and decoder module).

    python -m bench.compare --runs shipped,shipped-graphs-off,gpu-bound-sm16,ckpt
    python -m bench.compare --standin-profile outliers   # the real model's fp16 extremes: docs/outliers.md
    python -m bench.compare --shapes shipped,long,short [--cold | --no-cold]
    python -m bench.compare --sms 16 --runs shipped     # every run in a 16-SM partition

--runs: named runs from one registry (bench/runs.py: RUNS), each a comparison under stated
conditions: dataset shape, per-variant environment, workload overrides, stand-in profile, SM
partition, cold caches, which passes. shipped (the defaults), shipped-graphs-off (the solution
with SOLUTION_CUDA_GRAPHS=0), gpu-bound-sm16 (both variants in a 16-SM partition of the GPU,
bench/partition.py), ckpt (gradient checkpointing on for both), long and short (dataset shapes
from workload/data/kazakh.py, written into the output dir), shipped-cold (empty Triton and
Inductor caches), shipped-same-allocator (the baseline with expandable segments, the allocator
setting apply() gives the solution), outliers (the stand-in with the real model's fp16 extremes).
--shapes and --cold name the same runs the old way (default: shipped, long, short and
shipped-cold on a GPU, shipped only on a CPU). --sms N: every run in an N-SM partition, renamed
<run>-sm<N>. Each run is timed (both variants); on a GPU, where the run has them, a profiled pass
(GPU kernel time, own-kernel share), the solution's profiled pass with graphs off and the
host-split pass. Only the timed runs give the time, memory and loss figures.
Writes runs/<timestamp>/report.{json,md,png} and summary.json (every run's figures under its
name, with the call it came from: for bench.summary_merge and bench.rebuild_report, which
assemble the runs of several calls) and prints a summary and the rule check.

Every input is checked before the first run (paths, which are relative to the caller's working
directory; the workload file; the dataset and its row count against the workload; the model's
architecture; the solution's $SOLUTION_* settings): a bad one is refused with one line,
`error: ...` on stderr. Exit status: 0 every rule passed, 1 a rule failed (or a run failed, or
went past its wall-clock limit, --child-timeout SECONDS, default 3600: it is stopped), 2 bad input
(nothing run, nothing overwritten); 130 / 143 on SIGINT / SIGTERM (the running child is stopped;
what was written is kept).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import repeats
from bench import report as report_mod
from bench import runs as runs_mod
from bench import t4_projection
from bench.own_kernels import categorize, is_own_kernel
from bench.rules import check_run, check_static, print_rows
from bench.runs import COLD, EAGER_PROFILED, MODE_ENV, RUNS, SHAPES, VARIANTS, RunsError, RunSpec
from workload.model_standin import PROFILES

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "workload" / "data" / "kazakh_instructions.jsonl"


MACHINE_FILE = "machine.json"  # the comparison's GPU, versions, command and runs, written before its runs
CACHE_ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")  # emptied for a cold run


class InputError(Exception):
    """Bad user input: printed as a one-line error, nothing written is lost."""


# Each child run's wall-clock limit (--child-timeout). Generous on purpose: a cold T4 run of the
# baseline (the slowest pass: Soup's model load, 4-bit quantization and 64 fp16 steps, with empty
# kernel caches) takes a few minutes, so an hour is far above any healthy pass, and only a child
# that hangs (a stuck GPU call, a deadlock) meets it.
CHILD_TIMEOUT_S = 3600.0


class ChildTimeout(RuntimeError):
    """A child run went past its wall-clock limit and was stopped (a failed run: exit 1)."""


def parse_child_timeout(text: str | None) -> float:
    """--child-timeout: a positive, finite number of seconds; None: CHILD_TIMEOUT_S. Raises
    InputError."""
    if text is None:
        return CHILD_TIMEOUT_S
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"--child-timeout {text!r}: give a positive number of seconds, each child run's "
                         f"wall-clock limit (default {CHILD_TIMEOUT_S:g})")
    return value


def parse_shapes(text: str | None, cuda: bool) -> list[str]:
    """--shapes: comma-separated names from SHAPES, in the given order, no repeats. None: all of
    them on a GPU, shipped only on a CPU (the tiny stand-in stays quick). Raises InputError."""
    if text is None:
        return list(SHAPES) if cuda else ["shipped"]
    try:
        return runs_mod.parse_names(text, SHAPES, "shape")
    except RunsError as exc:
        raise InputError(f"--shapes {text!r}: {exc}") from exc


def plan_runs(shapes: list[str], cuda: bool, profile: bool = True, host_split: bool = True,
              cold: bool = False, profile_shapes: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The passes of --shapes / --cold, in order, as (run name, variant, mode): the runs of the
    same names (bench/runs.py: runs.plan over runs.from_shapes), the cold run last."""
    return runs_mod.plan([RUNS[n] for n in runs_mod.from_shapes(shapes, cold)], cuda, profile=profile,
                         host_split=host_split, profile_only=profile_shapes)


def select_runs(args, cuda: bool) -> list[RunSpec]:
    """The comparison's runs: --runs, or --shapes and --cold as runs (runs.from_shapes; default
    runs.DEFAULT_GPU on a GPU, DEFAULT_CPU on a CPU); each in --sms's partition (runs.with_sms).
    A run in a partition needs a GPU and a torch that has them (bench/partition.py). Raises
    InputError."""
    sms = getattr(args, "sms", None)
    try:
        if getattr(args, "runs", None) is not None:
            if args.shapes is not None or args.cold is not None:
                raise InputError("--runs names every run of the comparison (shipped-cold included): give it "
                                 "without --shapes / --cold")
            try:
                names = runs_mod.parse_names(args.runs, RUNS, "run")
            except RunsError as exc:
                raise InputError(f"--runs {args.runs!r}: {exc}") from exc
        else:
            names = runs_mod.from_shapes(parse_shapes(args.shapes, cuda), cuda if args.cold is None else args.cold)
        specs = [runs_mod.with_sms(RUNS[n], sms) for n in names]
    except RunsError as exc:
        raise InputError(str(exc)) from exc
    from bench.partition import unsupported

    for spec in specs:
        why = spec.sms and unsupported(spec.sms)
        if why:  # a registry run's own partition, or one that --sms asked for
            where = f"run {spec.name!r} ({spec.sms}-SM partition)" if spec.name in RUNS else f"--sms {spec.sms}"
            raise InputError(f"{where}: {why}")
    if getattr(args, "model", None):
        for spec in specs:
            if spec.standin_profile:
                raise InputError(f"run {spec.name!r} trains the stand-in's {spec.standin_profile!r} weights: give "
                                 "it without --model")
    return specs


def run_workloads(specs: list[RunSpec], base: str | Path) -> dict[str, str]:
    """The workload file of each run with overrides (RunSpec.workload), as YAML text: the base
    workload's keys with the overrides set, checked by workload/config.py as any workload file is
    (in a temporary file; bench.compare writes it into the run's folder). Raises InputError."""
    import yaml

    from workload.config import WorkloadConfigError, load_workload

    texts = {}
    for spec in specs:
        if not spec.workload:
            continue
        raw = yaml.safe_load(Path(base).read_text(encoding="utf-8"))
        for key, value in spec.workload.items():
            section, _, sub = key.partition(".")
            raw.setdefault(section, {})[sub] = value
        text = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "workload.yaml"
            path.write_text(text, encoding="utf-8")
            try:
                load_workload(path)
            except WorkloadConfigError as exc:
                raise InputError(f"run {spec.name!r}: its workload override {spec.workload} is refused: "
                                 f"{str(exc).partition(': ')[2] or exc}") from exc
        texts[spec.name] = text
    return texts


def git_commit() -> str:
    """This checkout's short commit; $BENCH_COMMIT when set (a copy of the tree without .git, as on
    the GPU machine); "unknown" otherwise."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT), capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


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
    info = {"name": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    if pins_first_gpu(os.environ):
        info["runs_on"] = f"the first of {torch.cuda.device_count()} visible GPUs (child_env sets CUDA_VISIBLE_DEVICES=0)"
    return info


def pins_first_gpu(environ) -> bool:
    """Several GPUs visible and no $CUDA_VISIBLE_DEVICES in ``environ``: the children run on the
    first one only (child_env)."""
    import torch

    return "CUDA_VISIBLE_DEVICES" not in environ and torch.cuda.is_available() and torch.cuda.device_count() > 1


CALLER_CWD_ENV = "BENCH_CALLER_CWD"  # set by scripts/compare.sh, which runs us from the repo root


def caller_path(path: str | Path) -> Path:
    """A path the user gave, absolute: a relative one is taken from the directory the user ran the
    command in ($BENCH_CALLER_CWD, which scripts/compare.sh sets before it changes directory; else
    this process's working directory), never from the repo (the children run there)."""
    path = Path(path).expanduser()
    if not path.is_absolute():
        path = Path(os.environ.get(CALLER_CWD_ENV) or os.getcwd()) / path
    return Path(os.path.abspath(path))


def check_out(out: Path) -> None:
    """--out: a directory (made if missing) that holds no report yet. Raises InputError."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a directory (nothing was overwritten)")
    if (out / "report.json").exists():
        raise InputError(f"{out} already holds a report; pass another --out (nothing was overwritten)")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InputError(f"--out {out}: {parent} is a file, not a directory")


def check_solution_settings() -> None:
    """The solution's own checks of its $SOLUTION_* settings (solution._apply.check_settings, the
    ones apply() makes before installing anything), made here before the first run. Raises
    InputError."""
    from solution._apply import check_settings

    try:
        check_settings()
    except ValueError as exc:
        raise InputError(str(exc)) from exc


QWEN2 = ("qwen2", "Qwen2ForCausalLM")  # config.json model_type, and the architecture it must list


def check_model(model: Path) -> None:
    """--model: a Hugging Face Qwen2 model dir (config.json with model_type qwen2 and
    Qwen2ForCausalLM among its architectures: the workload's model, and what the solution's patches
    replace). Raises InputError."""
    if not model.exists():
        raise InputError(f"model directory not found: {model}")
    if not model.is_dir():
        raise InputError(f"--model {model} is a file, not a model directory")
    cfg_path = model / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"model path {model} is not a Hugging Face model dir (no config.json)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InputError(f"{cfg_path} is not readable JSON ({' '.join(str(exc).split())})") from exc
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path} is not a model config (expected a JSON object)")
    model_type, archs = cfg.get("model_type"), cfg.get("architectures")
    if model_type != QWEN2[0] or not isinstance(archs, list) or QWEN2[1] not in archs:
        raise InputError(f"model {model} is model_type {model_type!r}, architectures {archs}: the workload and "
                         f"the solution are for Qwen2 (model_type {QWEN2[0]!r}, {QWEN2[1]}), e.g. "
                         "Qwen2.5-1.5B-Instruct")


def check_data(data: Path, workload) -> int:
    """The dataset: a readable alpaca JSONL file (workload/data/validate.py) with exactly the
    workload's number of examples, so that Soup trains the workload's steps. Returns its row count;
    raises InputError."""
    from workload.data.validate import validate_dataset

    if not data.exists():
        raise InputError(f"dataset not found: {data}")
    if not data.is_file():
        raise InputError(f"dataset {data} is not a file")
    try:
        rows = validate_dataset(data)
    except ValueError as exc:
        raise InputError(f"dataset {data}: {exc}") from exc
    if rows != workload.examples:
        raise InputError(
            f"dataset {data} has {rows} rows, but the workload trains on {workload.examples} examples "
            f"({workload.steps} steps of batch {workload.batch_size}); {rows} rows would train "
            f"{workload.steps_for(rows)} steps: give a file of {workload.examples} rows, or a --workload with "
            f"examples: {rows} and steps: {workload.steps_for(rows)}")
    return rows


def resolve_inputs(args, workload=None) -> tuple[str, str, str]:
    """Model dir, data file, size label, every one checked (check_model, check_data, the
    tokenizer); the stand-in is written (or reused) last, when every check has passed (its weights
    profile: --standin-profile where the parser has one, else the default). ``args``' paths are
    absolute (caller_path). Raises InputError with a clear message."""
    import torch

    from workload.config import load_workload

    workload = workload or load_workload()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (7, 0):
        major, minor = torch.cuda.get_device_capability()
        raise InputError(f"GPU {torch.cuda.get_device_name()} (sm_{major}{minor}) has no fast fp16 training path; "
                         "the workload is fp16 mixed precision (a T4 is sm_75)")
    if args.model and args.tokenizer:
        raise InputError("--tokenizer is for the stand-in model only; a --model dir brings its own tokenizer "
                         "(pass one of them)")
    data = Path(args.data) if args.data else DEFAULT_DATA
    check_data(data, workload)
    if args.model:
        model = Path(args.model)
        check_model(model)
        return str(model), str(data), "user model"
    from workload.tokenizer import check_source

    if args.tokenizer:
        try:
            check_source(Path(args.tokenizer))
        except FileNotFoundError as exc:
            raise InputError(f"--tokenizer: {exc}") from exc
    size = standin_size(args)
    return standin_model(args, workload, getattr(args, "standin_profile", None)), str(data), f"stand-in ({size})"


def standin_size(args) -> str:
    """--size, with auto resolved: full on CUDA, tiny on a CPU."""
    import torch

    return args.size if args.size != "auto" else ("full" if torch.cuda.is_available() else "tiny")


def standin_model(args, workload, profile: str | None = None) -> str:
    """The stand-in model dir of --size and weights ``profile`` (None: the default weights;
    workload/model_standin.py's write_standin(profile=...)), written or reused. Raises InputError."""
    import inspect

    from workload.model_standin import write_standin

    size = standin_size(args)
    if profile and "profile" not in inspect.signature(write_standin).parameters:
        raise InputError(f"the stand-in profile {profile!r} needs workload/model_standin.py's "
                         "write_standin(profile=...), which this tree does not have")
    cache = ROOT / ".cache" / "models" / f"qwen2.5-1.5b-instruct-standin-{size}{'-' + profile if profile else ''}"
    print(f"[compare] model stand-in ({size}{', ' + profile if profile else ''}): {cache}", flush=True)
    try:
        write_standin(cache, size=size, seed=workload.standin_seed, tokenizer_source=args.tokenizer,
                      **({"profile": profile} if profile else {}))
    except (RuntimeError, FileNotFoundError, ValueError) as exc:  # no tokenizer files; an unknown profile
        raise InputError(" ".join(str(exc).split())) from exc
    return str(cache)


def _progress(log_path: Path, proc: subprocess.Popen, label: str, limit_s: float | None = None) -> bool:
    """A one-line live display of the child's step (from its progress bar in the log), until the
    child exits or has run ``limit_s`` seconds (None: no limit). On a terminal the line is redrawn;
    in a pipe a line is printed every ~15 s. Returns True when the limit was reached with the
    child still running (the caller stops it), False when the child exited."""
    tty = sys.stdout.isatty()
    t0 = last_print = time.time()
    last = ""
    while proc.poll() is None:
        if limit_s is not None and time.time() - t0 >= limit_s:
            print(("\r" if tty else "") + f"[compare] {label:<20} {'TIMED OUT':<14} {time.time() - t0:6.0f} s",
                  flush=True)
            return True
        time.sleep(1.0 if limit_s is None else min(1.0, max(0.01, t0 + limit_s - time.time())))
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
    return False


def _pass_args(mode: str, work: Path) -> list[str]:
    """bench.run_one's options for a pass: none when timed; the host-split pass also logs Triton's
    compiles (both are diagnosis; neither runs in a timed pass)."""
    if mode in ("profiled", EAGER_PROFILED):
        return ["--profile"]
    if mode == "hostsplit":
        return ["--host-split", str(work / "host_split.md"), "--compile-log", str(work / "compiles.md")]
    return []


def child_env(variant: str, cold: bool = False, environ: dict | None = None) -> dict:
    """The environment of a bench.run_one child (a copy of ``environ``, default os.environ). On a
    CPU the solution's kernels run in Triton's interpreter. ``cold``: a new empty temporary
    directory for each of CACHE_ENV, so no kernel compiled before is found (the caller removes
    them after the run). Several GPUs visible and no $CUDA_VISIBLE_DEVICES: the first one only, for
    baseline and solution alike (the challenge's workload is one T4; Soup's device_map="auto" would
    spread the model over every visible card: another workload, e.g. on Kaggle's "GPU T4 x2")."""
    import torch

    env = dict(os.environ if environ is None else environ)
    if variant == "solution" and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # CPU: our kernels run in Triton's interpreter
    if pins_first_gpu(env):
        env["CUDA_VISIBLE_DEVICES"] = "0"
    if cold:
        for key in CACHE_ENV:
            env[key] = tempfile.mkdtemp(prefix=f"bench-cold-{variant}-{key.split('_')[0].lower()}-")
    return env


def run_variant(variant: str, model: str, data: str, out: Path, mode: str, workload: str | None,
                label: str | None = None, cold: bool = False, env: dict | None = None,
                sms: int | None = None, run: str | None = None, timeout_s: float | None = None) -> dict:
    """One bench.run_one child: ``mode`` "timed" (no instrument), "profiled" (torch.profiler) or
    "hostsplit" (bench/host_split.py's timers); in ``out``/<variant>[-<mode>]. ``label`` prefixes
    the progress line; ``cold``: in empty Triton and Inductor caches (child_env); ``env``: the
    run's extra environment for this variant (RunSpec.variant_env); ``sms``: in an SM partition
    (bench.run_one --sms); ``run``: the run's name, for messages (default ``label``);
    ``timeout_s``: the child's wall-clock limit (default CHILD_TIMEOUT_S): past it the child is
    stopped (stop_child) and ChildTimeout raised. A child that fails raises RuntimeError."""
    name = variant if mode == "timed" else f"{variant}-{mode}"
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    child = child_env(variant, cold, environ={**os.environ, **(env or {})})  # a cold run's caches win
    child.update(MODE_ENV.get(mode, {}))
    cmd = [sys.executable, "-m", "bench.run_one", "--variant", variant, "--model", model, "--data", data,
           "--workdir", str(work)] + (["--workload", workload] if workload else [])
    cmd += _pass_args(mode, work) + (["--sms", str(sms)] if sms else [])
    if cold:  # what the first step still compiles, and what compiled before training (diagnosis; cheap hooks)
        cmd += ["--compile-log", str(work / "compiles.md")]
    log_path = work / "log.txt"
    limit_s = CHILD_TIMEOUT_S if timeout_s is None else timeout_s
    timed_out = False
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=child)
            try:
                timed_out = _progress(log_path, proc, f"{label}/{name}" if label else name, limit_s)
            except BaseException:  # SIGINT / SIGTERM (Interrupted, KeyboardInterrupt) or any error here
                stop_child(proc)
                raise
            if timed_out:
                stop_child(proc)
    finally:
        if cold:
            for key in CACHE_ENV:
                shutil.rmtree(child[key], ignore_errors=True)
    if timed_out:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        who = (f"run {run or label!r}, " if run or label else "") + f"variant {variant}, {mode} pass"
        raise ChildTimeout(f"{who}: still running after its {limit_s:g} s limit (--child-timeout), stopped; "
                           f"log {log_path}:\n{tail}")
    result = read_result(work, cold)
    if proc.returncode != 0 or result is None:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{name} run failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return result


def read_result(work: Path, cold: bool) -> dict | None:
    """A finished bench.run_one child's result.json (None when it wrote none), with what the
    comparison adds: whether Soup's closing console panel is in its log (one of Soup's outputs too:
    rich draws it into the log) and whether it ran in empty caches."""
    res_path, log_path = work / "result.json", work / "log.txt"
    if not res_path.exists():
        return None
    result = json.loads(res_path.read_text(encoding="utf-8"))
    result["soup_complete_panel"] = log_path.exists() and "Training Complete!" in log_path.read_text(
        encoding="utf-8", errors="replace")
    result["cold_caches"] = cold
    return result


def machine_record(args, model_label: str, data: str, specs: list[RunSpec] | None = None) -> dict:
    """The comparison's machine, versions, commit, command and runs (name -> RunSpec.to_dict()),
    taken once when it starts: in its report, and in MACHINE_FILE beside the runs for
    bench.rebuild_report."""
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": _gpu(),
            "versions": _versions(), "argv": args.argv, "model_label": model_label, "commit": git_commit(),
            "workload": args.workload, "data": data, "runs": {spec.name: spec.to_dict() for spec in specs or []}}


def run_dir(out: Path, name: str) -> Path:
    """Where a comparison in ``out`` keeps a run's passes: ``out`` itself for shipped, else out/<name>."""
    return out if name == "shipped" else out / name


def shape_data_path(out: Path, shape: str) -> Path:
    """Where a comparison in ``out`` writes the dataset of a generated shape (long, short)."""
    return out / "data" / f"kazakh-{shape}.jsonl"


def write_outputs(rep: dict, out: Path, note: str = "") -> None:
    """report.json, report.md (``note`` first), summary.json and report.png of a report, in ``out``."""
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str), encoding="utf-8")
    (out / "report.md").write_text(note + report_mod.markdown(rep), encoding="utf-8")
    report_mod.write_summary(rep, out / "summary.json")
    try:
        report_mod.plot(rep, out / "report.png")
    except Exception as exc:  # the plot is a convenience; never lose the report over it
        print(f"[compare] plot skipped: {exc}")


GRACE_S = 5.0  # how long a child has to exit after SIGTERM before it is killed
# How long a killed child is waited for. SIGKILL cannot be caught; a process that outlives it this
# long is stuck in the kernel (uninterruptible I/O, a hung driver call), and more waiting won't help.
KILL_WAIT_S = 5.0


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the comparison (main() exits 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _set_handlers(handler) -> dict | None:
    """Set ``handler`` for STOP_SIGNALS; the previous ones, or None off the main thread (where
    Python allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _restore_handlers(old: dict | None) -> None:
    for sig, handler in (old or {}).items():
        signal.signal(sig, handler)


def stop_child(proc: subprocess.Popen, grace_s: float | None = None) -> bool:
    """Terminate a running child (SIGTERM), kill it (SIGKILL) if it has not exited after
    ``grace_s`` (default GRACE_S), and reap it, waiting at most KILL_WAIT_S after the kill (past
    that a warning says it could not be reaped, and the caller goes on). Further SIGINT / SIGTERM
    meanwhile are ignored: the stop finishes. Returns whether the child was reaped."""
    old = _set_handlers(signal.SIG_IGN)
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=GRACE_S if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    print(f"warning: child pid {proc.pid} was sent SIGKILL but had not exited {KILL_WAIT_S:g} s "
                          "later; it could not be reaped, going on", file=sys.stderr, flush=True)
                    return False
        return True
    finally:
        _restore_handlers(old)


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


def shape_entry(data: str | None, base: dict, sol: dict, base_prof: dict | None = None,
                sol_prof: dict | None = None, sol_prof_eager: dict | None = None) -> dict:
    """A run key's entry of the report's "shapes": its data file and each variant's figures
    (report.run_figures; GPU kernel time from the profiled pass; ``sol_prof_eager``: the
    solution's profiled pass with graphs off, its GPU kernel time as "gpu_kernel_s_graphs_off"; the
    steps the GradScaler skipped, "skipped_steps"), and solution / baseline."""
    b = report_mod.run_figures(base, kernel_split(base_prof))
    s = report_mod.run_figures(sol, kernel_split(sol_prof), base)
    b["skipped_steps"], s["skipped_steps"] = base.get("skipped_steps"), sol.get("skipped_steps")
    r = report_mod.ratios(b, s)
    eager = kernel_split(sol_prof_eager)
    if eager:
        s["gpu_kernel_s_graphs_off"] = eager["total_gpu_s"]
        r["gpu_kernel_s_graphs_off"] = eager["total_gpu_s"] / b["gpu_kernel_s"] if b.get("gpu_kernel_s") else None
    return {"data": data, "baseline": b, "solution": s, "ratios": r}


def call_of(machine: dict, argv: list[str] | None = None) -> dict:
    """The call a run came from: its commit, start date and command (bench.compare's arguments:
    ``argv``, default the machine record's)."""
    argv = machine.get("argv") if argv is None else argv
    return {"commit": machine.get("commit") or "unknown", "date": machine.get("date"),
            "command": " ".join(["python", "-m", "bench.compare", *(argv or [])])}


def run_entry(key: str, runs: dict, spec: RunSpec | None, call: dict) -> dict:
    """A run's entry of the report's "shapes": shape_entry of its passes (``runs``: {"data",
    "baseline", "solution", and where run "baseline-profiled", "solution-profiled",
    "solution-profiled-eager"}), what the run is (``spec``, default the registry's of ``key``),
    the call it came from (runs["call"], default ``call``) and its children's SM partitions."""
    e = shape_entry(runs.get("data"), runs["baseline"], runs["solution"], runs.get("baseline-profiled"),
                    runs.get("solution-profiled"), runs.get(f"solution-{EAGER_PROFILED}"))
    spec = spec or RUNS.get(key)
    if spec is not None:
        e["run"] = {"about": spec.about, "about_ru": spec.about_ru, "conditions": runs_mod.describe(spec)}
    e["call"] = runs.get("call") or call
    parts = {v: runs[v]["partition"] for v in VARIANTS if runs[v].get("partition")}
    if parts:
        e["partition"] = parts
    return e


def build_report(args, model_label, base, sol, base_prof, sol_prof, workload, base_split=None, sol_split=None,
                 shape: str = "shipped", data: str | None = None, others: dict | None = None,
                 machine: dict | None = None, sol_prof_eager: dict | None = None,
                 specs: dict | None = None, repeated: dict | None = None) -> dict:
    """The report of the ``shape`` run (time, memory, kernels, host split, rules), plus "shapes":
    the figures of every run (``shape`` first, then ``others``: name -> {"data", "baseline",
    "solution", and where run "baseline-profiled", "solution-profiled", "solution-profiled-eager",
    "call"}), whose timed results are kept in "shape_runs" for the rule check; each with what it
    is (``specs``: name -> RunSpec, default the registry's) and the call it came from (default
    this one). ``machine``: the comparison's date, GPU, versions and commit (machine_record);
    None: this machine's, now. ``sol_prof_eager``: the solution's profiled pass with graphs off
    (plan's "profiled-eager"), or None. The T4 projection takes the solution's eager host time
    from run shipped-graphs-off where the report has it; a run in an SM partition gets the model's
    prediction from the shipped run beside its measurement. ``repeated``: name -> the choice among
    repeated pairs (bench/repeats.py), kept in the run's entry as "repeats"."""
    if machine is None:
        machine = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": _gpu(),
                   "versions": _versions(), "commit": git_commit()}
    specs = specs or {}
    rep = {
        "date": machine["date"],
        "gpu": machine["gpu"],
        "versions": machine["versions"],
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench.compare"] + (args.argv or [])),
        "model": model_label,
        "workload": {"steps": workload.steps, "examples": workload.examples, "batch_size": workload.batch_size,
                     "max_length": workload.max_length},
        "baseline": base,
        "solution": sol,
        "kernel_split": {"baseline": kernel_split(base_prof), "solution": kernel_split(sol_prof),
                         "solution_graphs_off": kernel_split(sol_prof_eager)},
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
        own = split["by_category_s"].get(report_mod.OWN_CATEGORY, 0.0)
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
    rep["commit"] = machine.get("commit") or git_commit()
    rep["shape"] = shape
    call = call_of({**machine, "commit": rep["commit"]}, args.argv)
    primary = {"data": data, "baseline": base, "solution": sol, "baseline-profiled": base_prof,
               "solution-profiled": sol_prof, f"solution-{EAGER_PROFILED}": sol_prof_eager}
    every = {shape: primary, **(others or {})}
    rep["shapes"] = {key: run_entry(key, runs, specs.get(key), call) for key, runs in every.items()}
    for key, choice in (repeated or {}).items():
        rep["shapes"][key]["repeats"] = choice
    rep["shape_runs"] = {key: {v: runs[v] for v in VARIANTS} for key, runs in (others or {}).items()}
    # T4 projection (bench/t4_projection.py): a model from the shipped run's profiled and timed passes,
    # the solution's eager host time from run shipped-graphs-off where this report has it
    eager_timed = (every.get(t4_projection.EAGER_RUN) or {}).get("solution")
    rep["t4_projection"] = t4_projection.project(base, base_prof, sol, sol_prof, steps=workload.steps,
                                                 device=rep["gpu"]["name"], shape=shape,
                                                 sol_prof_eager=sol_prof_eager, sol_eager_timed=eager_timed)
    against = t4_projection.against_partition(rep["t4_projection"], rep["shapes"].get(t4_projection.PARTITION_RUN))
    if against:
        rep["t4_projection"]["against"] = against
    for key, e in rep["shapes"].items():
        if "partition" in e:
            rates = next(p.get("rates") for p in e["partition"].values())
            whole = {**(every.get("shipped") or {}), "solution-graphs-off": eager_timed}
            e["prediction"] = t4_projection.predict_partition(whole, rates, every[key], steps=workload.steps)
    rep["rules"] = check_static() + check_run(rep)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a real Qwen2.5-1.5B-Instruct dir (default: seeded random stand-in)")
    ap.add_argument("--data", help="dataset file (default: the embedded 256 Kazakh examples)")
    ap.add_argument("--tokenizer", help="tokenizer dir for the stand-in (default: built offline)")
    ap.add_argument("--size", choices=["auto", "tiny", "full"], default="auto",
                    help="stand-in size: full on CUDA, tiny on CPU (auto)")
    ap.add_argument("--standin-profile", choices=[p for p in PROFILES if p != "default"],
                    help="the stand-in's weights (default: seeded random): outliers, plus the real model's "
                    "massive activations and super weights (docs/outliers.md)")
    ap.add_argument("--workload", help="workload YAML (default workload/workload.yaml)")
    ap.add_argument("--out", type=Path, help="output dir (default runs/<timestamp>)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled passes")
    ap.add_argument("--profile-shapes", help="profile only these runs (comma-separated run names; default: every "
                    "run that has a profiled pass); the others get their timed pass only")
    ap.add_argument("--no-host-split", action="store_true", help="skip the host-split passes")
    ap.add_argument("--runs", help="comma-separated named runs (bench/runs.py): " + ", ".join(RUNS)
                    + " (instead of --shapes / --cold)")
    ap.add_argument("--shapes", help="comma-separated dataset shapes from shipped,long,short (default: all "
                    "three on a GPU, shipped on a CPU)")
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=None,
                    help="the cold pass: baseline and solution once more (shipped shape, timed) in empty "
                    "Triton/Inductor caches (default: on a GPU only)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help=f"each run's timed pass N times per variant (1-{repeats.MAX_REPEAT}), interleaved; the "
                    "pair with the median steps 3-N ratio stands for the run, every pair is listed (bench/repeats.py)")
    ap.add_argument("--sms", type=int, metavar="N", help="every run with every CUDA stream in a green context of "
                    "N SMs (a GPU-bound machine; bench/partition.py; torch >= 2.11), named <run>-sm<N>")
    ap.add_argument("--child-timeout", metavar="SECONDS",
                    help=f"each child run's wall-clock limit (default {CHILD_TIMEOUT_S:g}); past it the child is "
                    f"stopped (SIGTERM, SIGKILL after {GRACE_S:g} s) and the comparison exits 1")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    old_handlers = _set_handlers(_raise_interrupted)  # SIGINT / SIGTERM: stop the child, exit 130 / 143
    try:
        return _main(args)
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"error: interrupted by {signal.Signals(signum).name}: the running child (if any) was stopped; "
              f"what was written is kept{f' in {args.out_dir}' if getattr(args, 'out_dir', None) else ''}",
              file=sys.stderr)
        return 128 + int(signum)
    finally:
        _restore_handlers(old_handlers)


def _main(args) -> int:
    """main() after parsing: every check, then the runs, the report and the rule check."""
    import torch

    cuda = torch.cuda.is_available()
    from workload.config import WORKLOAD_FILE, WorkloadConfigError, load_workload

    # Every user path is taken from the caller's directory (caller_path), before anything else.
    for name in ("model", "data", "tokenizer", "workload", "out"):
        if getattr(args, name):
            setattr(args, name, str(caller_path(getattr(args, name))))
    out = Path(args.out) if args.out else ROOT / "runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        specs = select_runs(args, cuda)
        names = [spec.name for spec in specs]
        profile_only = None
        if args.profile_shapes is not None:
            try:
                profile_only = runs_mod.parse_names(args.profile_shapes, names, "run of this comparison")
            except RunsError as exc:
                raise InputError(f"--profile-shapes {args.profile_shapes!r}: {exc}") from exc
        if not 1 <= args.repeat <= repeats.MAX_REPEAT:
            raise InputError(f"--repeat {args.repeat}: give 1 to {repeats.MAX_REPEAT}")
        child_timeout = parse_child_timeout(getattr(args, "child_timeout", None))
        check_out(out)
        check_solution_settings()
        workload = load_workload(args.workload or WORKLOAD_FILE)
        overrides = run_workloads(specs, args.workload or WORKLOAD_FILE)
        model, data, model_label = resolve_inputs(args, workload)
        models = {None: model}
        for profile in dict.fromkeys(spec.standin_profile for spec in specs if spec.standin_profile):
            models[profile] = standin_model(args, workload, profile)
        out.mkdir(parents=True, exist_ok=True)
    except (InputError, WorkloadConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out cannot be made (permissions, a file in its path)
        print(f"error: --out {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    args.out_dir = out
    print(f"[compare] {model_label}, data {data}, output {out}", flush=True)
    # in the report, and what bench.rebuild_report needs if this comparison is cut before it writes one
    machine = machine_record(args, model_label, data, specs)
    if machine["gpu"].get("runs_on"):
        print(f"[compare] runs on {machine['gpu']['runs_on']}", flush=True)
    (out / MACHINE_FILE).write_text(json.dumps(machine, indent=1), encoding="utf-8")
    workloads = {}
    for name, text in overrides.items():
        path = run_dir(out, name) / "workload.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        workloads[name] = str(path)
    datas = {"shipped": data}
    if {spec.shape for spec in specs} - {"shipped"}:
        from transformers import AutoTokenizer

        from workload.data.kazakh import make_shape_dataset

        tokenizer = AutoTokenizer.from_pretrained(model)  # the run's own tokenizer measures the rows
        for shape in dict.fromkeys(spec.shape for spec in specs if spec.shape != "shipped"):
            datas[shape] = str(make_shape_dataset(shape, shape_data_path(out, shape), n=workload.examples,
                                                  tokenizer=tokenizer))
            print(f"[compare] dataset shape {shape}: {datas[shape]}", flush=True)
    plan = runs_mod.plan(specs, cuda, profile=not args.no_profile, host_split=not args.no_host_split,
                         profile_only=profile_only, repeat=args.repeat)
    by_name = {spec.name: spec for spec in specs}
    print(f"[compare] {len(plan)} runs: " + "; ".join(
        f"{key} " + ", ".join(dict.fromkeys(m for k, _, m in plan if k == key)) for key in names), flush=True)
    results: dict = {}
    t0 = time.time()
    for i, (key, variant, mode) in enumerate(plan, 1):
        spec = by_name[key]
        try:
            results[key, variant, mode] = run_variant(
                variant, models[spec.standin_profile], datas[spec.shape], run_dir(out, key), mode,
                workloads.get(key, args.workload), label=None if key == "shipped" else key, cold=spec.cold,
                env=spec.variant_env(variant), sms=spec.sms, run=key, timeout_s=child_timeout)
        except RuntimeError as exc:  # the child failed or went past its limit: its log's tail, then one line
            head, _, tail = str(exc).partition("\n")
            print(tail, file=sys.stderr)
            print(f"error: {head.rstrip(':')}", file=sys.stderr)
            return 1
        if i < len(plan):
            left = (time.time() - t0) / i * (len(plan) - i)
            print(f"[compare] {i}/{len(plan)} runs done, about {left / 60:.0f} min left", flush=True)
    primary = "shipped" if "shipped" in names else names[0]
    choices = {}
    for key in names:  # --repeat: the median pair stands for the run (bench/repeats.py)
        passes = {repeats.folder(v, i): results[key, v, repeats.timed_mode(i)]
                  for v in VARIANTS for i in range(1, args.repeat + 1)}
        choice = repeats.apply_choice(passes)
        if choice is not None:
            choices[key] = choice
            for v in VARIANTS:
                results[key, v, "timed"] = passes[v]

    def get(key, variant, mode="timed"):
        return results.get((key, variant, mode))

    others = {key: {"data": datas[by_name[key].shape], **{v: get(key, v) for v in VARIANTS},
                    **{f"{v}-profiled": get(key, v, "profiled") for v in VARIANTS},
                    f"solution-{EAGER_PROFILED}": get(key, "solution", EAGER_PROFILED)}
              for key in names if key != primary}
    rep = build_report(args, model_label, get(primary, "baseline"), get(primary, "solution"),
                       get(primary, "baseline", "profiled"), get(primary, "solution", "profiled"), workload,
                       get(primary, "baseline", "hostsplit"), get(primary, "solution", "hostsplit"),
                       shape=primary, data=datas[by_name[primary].shape], others=others, machine=machine,
                       sol_prof_eager=get(primary, "solution", EAGER_PROFILED), specs=by_name,
                       repeated=choices)
    write_outputs(rep, out)
    print()
    print(report_mod.summary_table(rep))
    print("Rule check:")
    ok = print_rows(rep["rules"])
    print(f"\nReport: {out / 'report.md'} (JSON, PNG and summary.json beside it)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
