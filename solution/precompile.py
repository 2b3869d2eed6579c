"""Compile our Triton kernels before their first launch, in a background thread that apply()
starts, from specializations recorded earlier with the same Triton version on any GPU.

What it replaces: without it Triton compiles each of our kernels the first time training launches
it, one after the other inside the first step (docs/PERFORMANCE.md gives the measured cold first
step). Soup spends several seconds importing its libraries and loading and quantizing the model
after apply() and before that first step: the compiles can run meanwhile.

What it does instead: ``bench.run_one --compile-log`` records, through Triton's compile hooks,
Triton's own serialized specialization of every compile of a run (argument types, alignment
attributes, constexprs, options and the JIT cache key). ``python -m solution.precompile add
compiles.json`` keeps those of our kernels in ``solution/kernels/compile_manifest.json``, tagged
with the GPU architecture and Triton version they were recorded with. On CUDA (unless
$SOLUTION_PRECOMPILE=0), apply() starts a daemon thread. It first runs compile processes (one per
spare core, at most 4: ``python -m solution.precompile compile``) that compile the entries for
this GPU's target into Triton's disk cache, with no GPU and none of this process's GIL, and also
build each kernel's C launcher and Triton's CUDA utility module there. Then it calls Triton's
``JITFunction.preload(data)`` here for every entry of this Triton version (a disk hit for what
the processes compiled), **retargeted to this GPU**
(``retarget``): the recorded options that belong to the machine it was recorded on (its
architecture, its fp8 types, the path of its libdevice) are dropped, so Triton's backend fills in
this GPU's. The kernel is compiled into the JIT's cache under the recorded key, so the first launch
finds it. No tensors, no launches, no random numbers, no GPU memory: only compilation. Measured
figures: docs/PERFORMANCE.md.

Why a record from another GPU fits: our launchers choose block sizes and warps from the tensors'
shapes and dtypes only (none asks the device; the sizes that vary per batch, the token counts, are
``do_not_specialize``), so a run on a T4 launches the same specializations as a run on the H200
with the same model and Triton. The JIT cache key holds no architecture either.

Risks: an entry recorded with another launch configuration compiles something the run never
launches: wasted background CPU, nothing else. A preload that fails is counted and reported,
never raised. The thread competes with Soup's model loading for the CPU (Python parts of the
compile hold the GIL). If training reaches a kernel before the thread did, Triton compiles it as
without this module. A CUDA-graph capture waits for the thread first (``wait``): a module load
during a capture is not allowed.

Bounded: nothing here can hang training. The whole precompile has LIMIT_S seconds from its start;
past them its compile processes are ended (SIGTERM, SIGKILL after KILL_GRACE_S), the thread starts
no further preload, STATE["stopped"] says why, one ``[solution]`` line says so, and the kernels not
compiled yet compile at their first launch, as without this module (``give_up``). ``wait()``
without a timeout returns at that limit at the latest. A preload still inside a compile call then
(a thread cannot be ended) finishes that compile only: Triton's ``preload`` compiles and caches,
and loads a binary onto the GPU only at its first launch, so it cannot load a module during a
capture.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from solution import settings

ENV = "SOLUTION_PRECOMPILE"
from solution.compile_manifest import (MANIFEST, OWN_PREFIX, add_to_manifest, entries_for,  # noqa: F401
                                       load_manifest, manifest_path, same_record_format)

# The limits that keep a hung compile (a driver or ptxas stall on an unfamiliar machine) from
# hanging training. LIMIT_S: the most the whole precompile may take from its start, compile
# processes and in-process preload together, and the most ``wait()`` waits by default. Measured
# on the H200 host: 6.1 s in 4 compile processes plus 1.2 s of preloads (docs/PERFORMANCE.md,
# "Cold start"); a 2-core notebook runs one process on a slower core, a few times that. 300 s is
# ~40x the measured time. KILL_GRACE_S: how long a compile process has to exit after SIGTERM
# before SIGKILL (bench.compare gives its runs the same).
LIMIT_S = 300.0
KILL_GRACE_S = 5.0

# finished_t: time.perf_counter() when the thread ended (None while it runs or never started);
# stopped: why the precompile was given up (None: it was not), stopped_t: when
STATE: dict = {"started": False, "entries": 0, "done": 0, "failed": 0, "seconds": None, "errors": [],
               "started_t": None, "finished_t": None, "workers": 0, "worker_compiled": None, "worker_seconds": None,
               "preload_started_t": None, "stopped": None, "stopped_t": None}
_thread: threading.Thread | None = None
_stop = threading.Event()  # set by give_up: the thread starts no further compile
_stop_lock = threading.Lock()
_procs: list = []  # the running compile processes (subprocess.Popen), for give_up
_say = None  # the printer start() was given (None: solution.say.say)


def requested() -> bool:
    """On by default; $SOLUTION_PRECOMPILE=0 (or false/off/no) turns it off (settings.current())."""
    return settings.current().precompile


# The options a launch sets (kernel[grid](..., num_warps=...)) or that do not depend on the machine:
# kept from the record. Everything else (arch, fp8 types, libdevice's path, dot precisions, ...)
# is the recording machine's and is left to this GPU's backend (CUDABackend.parse_options).
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg", "enable_fp_fusion", "enable_reflect_ftz",
                  "launch_cooperative_grid", "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode")


def retarget(data: str, target: dict | None = None) -> str:
    """A serialized specialization with only its launch options kept (see LAUNCH_OPTIONS), so that
    ``preload`` compiles it for the GPU it runs on; with ``target`` (the running GPU's
    GPUTarget.__dict__) also its target, which Triton >= 3.7's preload requires to be the running
    one. Data that is not such JSON is returned as is."""
    try:
        obj = json.loads(data)
        options = obj["options"]
    except (ValueError, KeyError, TypeError):
        return data
    obj["options"] = {k: v for k, v in options.items() if k in LAUNCH_OPTIONS}
    if target is not None:
        obj["target"] = dict(target)
    return json.dumps(obj)


def _running_target() -> dict | None:
    """The current GPU's Triton target as a dict (backend, arch, warp_size), or None."""
    try:
        from triton.runtime import driver

        return dict(driver.active.get_current_target().__dict__)
    except Exception:  # noqa: BLE001 - no driver here: preload without a target
        return None


def resolve_kernel(path: str):
    """The @triton.jit function named "solution.kernels.<module>.<name>", or None (another
    package, a missing name, or not a JIT function with ``preload``)."""
    if not path.startswith(OWN_PREFIX) or path.count(".") != 3:
        return None
    module_name, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    return fn if callable(getattr(fn, "preload", None)) else None


def compile_record(fn, data: str, target) -> None:
    """Compile one recorded specialization of ``fn`` for ``target`` (a triton GPUTarget) into
    Triton's disk cache, without a GPU: the steps of ``JITFunction.preload`` up to its compile,
    with the backend made from ``target`` instead of the current device. The JIT's own compile of
    that specialization at launch then finds the binary on disk. ``data`` is retargeted first."""
    import triton.language as tl
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    try:  # Triton >= 3.6 turns JSON lists back into tuples; older ones read the signature as is
        from triton.runtime.jit import convert_to_tuple_if_list
    except ImportError:
        def convert_to_tuple_if_list(value):
            return value

    obj = json.loads(retarget(data))
    constexprs = {tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else
                             tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v)
                  for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()}
    backend = make_backend(target)
    options = backend.parse_options(options)
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton_compile(src, target=target, options=options.__dict__)
    if target.backend == "cuda":
        _build_launcher(src, kernel.metadata)


def _build_launcher(src, metadata) -> None:
    """Also build the kernel's C launcher (Triton compiles one per signature with the C compiler
    at the kernel's first launch and keeps it in the same disk cache): the steps of
    CudaLauncher.__init__ up to its build. Needs the CUDA driver library on the machine, not a GPU
    context; where it fails, the first launch builds it as without this module."""
    try:
        from triton.backends.nvidia import driver as nv

        constants = getattr(src, "constants", {}) or {}
        arg_idx = lambda x: (src.fn.arg_names.index(x), ) if isinstance(x, str) else x  # noqa: E731
        nv.compile_module_from_src(
            src=nv.make_launcher({arg_idx(k): v for k, v in constants.items()}, dict(src.signature.items()),
                                 getattr(metadata, "tensordesc_meta", None)),
            name="__triton_launcher", library_dirs=nv.library_dirs(), include_dirs=nv.include_dirs,
            libraries=nv.libraries)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


def _build_driver_utils() -> None:
    """Triton's CUDA utility module (compiled with the C compiler once per cache directory when
    the driver first starts): built here too, so that the training process finds it."""
    try:
        from triton.backends.nvidia import driver as nv

        nv.CudaUtils()
    except Exception:  # noqa: BLE001 - no CUDA driver library here: the training process builds it
        pass


def worker_count(n_entries: int) -> int:
    """Compile processes: one per spare core this process may run on (its CPU affinity, not the
    machine's count, and no more than a container's CPU quota allows; one core stays with Soup's
    loading), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(0, min(n_entries, cores - 1, MAX_WORKERS))


MAX_WORKERS = 4
# the cgroup files that hold a container's CPU quota: v2 "cpu.max" ("<quota> <period>" or
# "max <period>"), v1 cpu.cfs_quota_us / cpu.cfs_period_us (quota -1: none)
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"


def cpu_quota() -> int | None:
    """The CPUs a container's cgroup quota allows this process (rounded up, at least 1), or None
    when there is no quota or it cannot be read. Affinity does not show a quota: a container given
    2 CPUs of a 64-core host sees 64 cores, and 4 compile processes would then share 2 CPUs with
    Soup's loading."""
    import math

    try:
        with open(CGROUP_V2_CPU_MAX, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        with open(f"{CGROUP_V1_CPU}/cpu.cfs_quota_us", encoding="ascii") as f:
            quota_us = int(f.read())
        with open(f"{CGROUP_V1_CPU}/cpu.cfs_period_us", encoding="ascii") as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    if quota_us <= 0 or period_us <= 0:
        return None
    return max(1, math.ceil(quota_us / period_us))


def _start_workers(entries: list[dict], target: tuple, workers: int):
    """Start ``workers`` child processes (``python -m solution.precompile compile``) that compile
    ``entries`` for ``target`` (backend, arch, warp size), round robin; returns what
    ``_wait_workers`` needs. The children use no GPU and hold no GIL of this process: Soup's
    loading keeps its core. None (and the error noted) when they cannot start: the entries then
    compile in this process, at preload."""
    import tempfile

    try:
        tmp = tempfile.TemporaryDirectory(prefix="solution-precompile-")
        procs = []
        for w in range(workers):
            part = Path(tmp.name) / f"entries-{w}.json"
            part.write_text(json.dumps(entries[w::workers]), encoding="utf-8")
            out = Path(tmp.name) / f"done-{w}.json"
            # they compile for the GPU target, never in Triton's interpreter
            env = settings.child_environ(drop=("TRITON_INTERPRET",))
            # each leads a process group of its own (start_new_session), so that ending it also
            # ends a compiler it runs (ptxas)
            proc = subprocess.Popen(_worker_command(part, target, out), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                                    cwd=str(Path(__file__).resolve().parent.parent))
            _procs.append(proc)
            procs.append((proc, out))
        atexit.register(_end, procs=_procs, grace=1.0)  # none outlives this process (a hung one would)
    except Exception as exc:  # noqa: BLE001 - no child processes here
        STATE["errors"].append(f"workers: {type(exc).__name__}: {exc}"[:300])
        return None
    return tmp, procs


def _worker_command(part: Path, target: tuple, out: Path) -> list[str]:
    """One compile process's command line: compile the entries in ``part`` for ``target``, write
    how many compiled to ``out``."""
    import sys

    return [sys.executable, "-m", "solution.precompile", "compile", str(part), "--target",
            ":".join(map(str, target)), "--done", str(out)]


def _wait_workers(tmp, procs, deadline: float | None = None) -> int:
    """Wait for the children of ``_start_workers`` until ``deadline`` (a time.perf_counter(); None:
    for as long as they run); returns how many entries they compiled. Children still running at
    the deadline are ended, and the precompile is given up (``give_up``)."""
    done = 0
    with tmp:
        for proc, out in procs:
            try:
                proc.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                give_up(f"its compile processes were still running {LIMIT_S:.0f} s after it started")
            try:
                done += int(json.loads(out.read_text(encoding="utf-8"))["done"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if proc in _procs:
                _procs.remove(proc)
    return done


def _end(procs, grace: float) -> None:
    """End compile processes, each with its process group, by their own ids: SIGTERM, then
    SIGKILL to those still running ``grace`` seconds later; each is reaped if it exits within
    ``grace`` more (a process stuck in the kernel may not, and is left)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)  # the group it leads (start_new_session) has the child's id
            except (ProcessLookupError, PermissionError, AttributeError):  # gone, or no process groups here
                try:
                    proc.send_signal(sig)
                except OSError:
                    pass
        end = time.perf_counter() + grace
        for proc in alive:
            try:
                proc.wait(max(0.0, end - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass


def give_up(reason: str) -> bool:
    """Stop the background precompile: its compile processes are ended (``_end``), the thread
    starts no further preload, STATE["stopped"] holds ``reason``, and one line says so; kernels
    not compiled yet compile at their first launch (Triton's ordinary compile). Only the first
    call acts; returns whether this one did."""
    with _stop_lock:
        if _stop.is_set():
            return False
        _stop.set()
        STATE["stopped"], STATE["stopped_t"] = reason, time.perf_counter()
    _end(list(_procs), KILL_GRACE_S)
    say = _say
    if say is None:
        from solution.say import say
    say(f"precompile stopped: {reason}; kernels it had not compiled compile at their first launch "
        "(Triton's ordinary compile)")
    return True


def run(entries: list[dict], target: tuple | None = None, workers: int = 0) -> None:
    """The background thread's body: with ``workers`` > 0, child processes compile the entries
    for ``target`` into Triton's disk cache first (true parallelism, no GPU); then every entry is
    preloaded here into the JIT's in-memory cache (a disk hit for what the children compiled, a
    compile for the rest). Failures are counted, never raised. Bounded by LIMIT_S from its start:
    past it, or once the precompile is given up, no further compile starts (``give_up``).
    First, while the children start, Triton's own version key is computed here (it hashes
    Triton's sources and its ~100 MB-scale native library, once per process, at the first
    compile or cache lookup): otherwise the first kernel launch of the training step pays it."""
    t0 = time.perf_counter()
    STATE["started_t"] = t0
    deadline = t0 + LIMIT_S
    if workers > 0 and target is not None:
        pending = _start_workers(entries, target, workers)
    else:
        pending = None
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - another Triton layout: the first lookup computes it
        pass
    if pending is not None:
        try:
            STATE["worker_compiled"] = _wait_workers(*pending, deadline=deadline)
        except Exception as exc:  # noqa: BLE001 - no child processes here: compile in this process
            STATE["errors"].append(f"workers: {type(exc).__name__}: {exc}"[:300])
        STATE["worker_seconds"] = time.perf_counter() - t0
    running_target = _running_target()
    STATE["preload_started_t"] = time.perf_counter()
    for e in entries:
        if not _stop.is_set() and time.perf_counter() > deadline:
            give_up(f"its in-process preload was not done {LIMIT_S:.0f} s after it started")
        if _stop.is_set():
            break
        fn = resolve_kernel(e["kernel"])
        try:
            if fn is None:
                raise LookupError(f"no @triton.jit kernel {e['kernel']}")
            fn.preload(retarget(e["specialization_data"], running_target))
            STATE["done"] += 1
        except Exception as exc:  # noqa: BLE001 - a failed preload only means a compile at first use
            STATE["failed"] += 1
            if len(STATE["errors"]) < 5:
                STATE["errors"].append(f"{e['kernel']}: {type(exc).__name__}: {exc}"[:300])
    STATE["finished_t"] = time.perf_counter()
    STATE["seconds"] = STATE["finished_t"] - t0


def start(device: str, say=print) -> threading.Thread | None:
    """Start the background preload on CUDA (unless $SOLUTION_PRECOMPILE=0) when the manifest has
    entries for this Triton version; returns the thread (None when nothing starts; the reason is
    said, except when it was turned off or there is no GPU: then nothing was asked for)."""
    global _thread, _say
    if not requested() or device != "cuda":
        return None
    if _thread is not None:
        return _thread
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability()
    arch, version = f"sm_{major}{minor}", triton.__version__
    try:
        entries = entries_for(load_manifest(), version)
    except ValueError as exc:
        say(f"precompile skipped: {exc}")
        return None
    if not entries:
        say(f"precompile skipped: no recorded specializations for Triton {version} in {manifest_path()}; "
            "kernels compile at first use")
        return None
    workers = worker_count(len(entries))
    STATE.update(started=True, entries=len(entries), done=0, failed=0, seconds=None, errors=[], started_t=None,
                 finished_t=None, preload_started_t=None, stopped=None, stopped_t=None,
                 workers=workers, worker_compiled=None, worker_seconds=None)
    _stop.clear()
    _say = say
    target = ("cuda", major * 10 + minor, 32)
    _thread = threading.Thread(target=run, args=(entries, target, workers), name="solution-precompile", daemon=True)
    _thread.start()
    recorded = sorted({e["arch"] for e in entries})
    with_version = sorted({e["triton"] for e in entries})
    other = "" if with_version == [version] else (
        f"; recorded with Triton {', '.join(with_version)}, the same record format: a record that does not "
        "compile here is counted, and its kernel compiles at first use")
    say(f"precompiling {len(entries)} kernel specializations in the background for {arch} "
        f"(Triton {version}; recorded on {', '.join(recorded)}; {workers} compile processes{other})")
    return _thread


def running() -> bool:
    """The background preload is still compiling (and was not given up: a thread that is, starts
    no further compile)."""
    return _thread is not None and _thread.is_alive() and not _stop.is_set()


def contended(since: float) -> bool:
    """Did this process's part of the background work (the in-process preload, which holds the
    GIL for its Python steps) run at any time from ``since`` (a time.perf_counter()) until now?
    The compile processes do not count: each has a core of its own (worker_count leaves one to
    this process), so they do not slow this process's host work. Without them the whole compile
    runs in the preload, and so counts."""
    if _thread is None or STATE.get("preload_started_t") is None:
        return False  # nothing started, or only the compile processes are running
    ended = STATE.get("finished_t") or STATE.get("stopped_t")  # given up: it starts no compile any more
    return ended is None or ended >= since


def wait(timeout: float | None = None) -> dict:
    """Wait for the background preload (before a capture, before the first probe sample, in
    tests); returns STATE. With ``timeout``: at most that many seconds, and the preload goes on
    if it has not finished. Without: until LIMIT_S after the precompile started at the latest;
    if it is still running then, it is given up (``give_up``: its compile processes ended, the
    line said, STATE["stopped"] set) and this returns."""
    thread = _thread
    if thread is None:
        return dict(STATE)
    if timeout is not None:
        thread.join(timeout)
        return dict(STATE)
    started = STATE.get("started_t") or time.perf_counter()
    thread.join(max(0.0, started + LIMIT_S - time.perf_counter()))
    if thread.is_alive():
        give_up(f"it had not finished {LIMIT_S:.0f} s after it started")
        thread.join(KILL_GRACE_S)  # the thread stops at its next step; a compile stuck in a call is left behind
    return dict(STATE)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Add a run's recorded compiles of our kernels to the manifest.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="add the compiles of a compile log (.json) to the manifest")
    add.add_argument("compile_log_json", type=Path)
    add.add_argument("--arch", help="GPU architecture it was recorded on, e.g. sm_75 (default: the log's)")
    add.add_argument("--triton", help="Triton version it was recorded with (default: the log's)")
    add.add_argument("--manifest", type=Path, default=None, help=f"default: {MANIFEST}")
    comp = sub.add_parser("compile", help="(a compile process of the background precompile) compile entries "
                          "for a target into Triton's disk cache, no GPU needed")
    comp.add_argument("entries_json", type=Path)
    comp.add_argument("--target", required=True, help="backend:arch:warp_size, e.g. cuda:75:32")
    comp.add_argument("--done", type=Path, help="write {\"done\": N} here")
    args = ap.parse_args(argv)
    if args.cmd == "compile":
        return _compile_main(args)
    log = json.loads(args.compile_log_json.read_text(encoding="utf-8"))
    arch = args.arch or log.get("summary", {}).get("arch")
    version = args.triton or log.get("summary", {}).get("triton")
    if not arch or not version:
        print("error: the log does not say its architecture / Triton version; pass --arch and --triton")
        return 2
    n = add_to_manifest(args.compile_log_json, arch, version, args.manifest)
    print(f"added {n} specializations ({arch}, Triton {version}) to {args.manifest or manifest_path()}")
    return 0


def _compile_main(args) -> int:
    from triton.backends.compiler import GPUTarget

    backend, arch, warp = args.target.split(":")
    target = GPUTarget(backend, int(arch), int(warp))
    if backend == "cuda":
        _build_driver_utils()
    done = 0
    for e in json.loads(args.entries_json.read_text(encoding="utf-8")):
        fn = resolve_kernel(e["kernel"])
        try:
            if fn is not None:
                compile_record(fn, e["specialization_data"], target)
                done += 1
        except Exception:  # noqa: BLE001 - the parent's preload compiles what failed here
            pass
    if args.done:
        args.done.write_text(json.dumps({"done": done}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
