"""Compile our Triton kernels before their first launch, in a background thread apply() starts (on CUDA, unless
$SOLUTION_PRECOMPILE=0), from specializations recorded earlier with the same Triton on any GPU (guarantees and
measurements: docs/PERFORMANCE.md, "Cold start").

``python -m solution.precompile add compiles.json`` keeps our kernels' compiles of a run recorded by
``bench.run_one --compile-log`` (Triton's serialized specializations) in kernels/compile_manifest.json. The
thread starts compile processes (``worker_count``) that compile them for this GPU's target into Triton's disk
cache, with their C launchers (no GPU, not this process's GIL), then calls ``JITFunction.preload`` here for
each, ``retarget``-ed, so that the first launch finds it in the JIT's cache. A record from another GPU fits:
our launchers choose block sizes and warps from shapes and dtypes only (token counts are
``do_not_specialize``), and the JIT key holds no architecture. No tensors, launches or random numbers.

Never fatal: a failed preload is counted, never raised; a kernel not reached compiles at its first launch. A
CUDA-graph capture waits for the thread (``wait``: no module load during a capture). The whole precompile has
LIMIT_S from its start, then ``give_up``; a preload inside a compile finishes that one (it loads nothing on the GPU).
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
import types
from pathlib import Path

from solution import settings

ENV = "SOLUTION_PRECOMPILE"
from solution.compile_manifest import (MANIFEST, OWN_PREFIX, add_to_manifest, entries_for,  # noqa: F401
                                       load_manifest, manifest_path, same_record_format)

# A hung compile must not hang training. LIMIT_S: the most the precompile and ``wait()`` take from its start
# (~40x the 7.3 s measured on the H200 host); KILL_GRACE_S: from SIGTERM to SIGKILL of a compile process.
LIMIT_S = 300.0
KILL_GRACE_S = 5.0

# *_t: time.perf_counter() values (None: not yet); stopped: why it was given up (None: it was not)
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


# The options a launch sets or that do not depend on the machine: kept from the record. The rest (arch, fp8
# types, libdevice's path, ...) is the recording machine's, left to this GPU's backend (parse_options).
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg", "enable_fp_fusion", "enable_reflect_ftz",
                  "launch_cooperative_grid", "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode")


def retarget(data: str, target: dict | None = None) -> str:
    """A serialized specialization with only its LAUNCH_OPTIONS kept, so that ``preload`` compiles it for the
    running GPU; with ``target`` (its GPUTarget.__dict__) also that target (Triton >= 3.7's preload requires
    the running one). Data that is not such JSON is returned as is."""
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
    """The @triton.jit function named "solution.kernels.<module>.<name>" (with ``preload``), or None."""
    if not path.startswith(OWN_PREFIX) or path.count(".") != 3:
        return None
    module_name, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    return fn if callable(getattr(fn, "preload", None)) else None


def compile_record(fn, data: str, target) -> None:
    """Compile one recorded (retargeted) specialization of ``fn`` for ``target`` (a GPUTarget) into Triton's
    disk cache without a GPU: ``JITFunction.preload``'s steps up to its compile, the backend made from ``target``."""
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
    """Also build the kernel's C launcher into the disk cache (CudaLauncher.__init__'s steps; needs the CUDA
    driver library, not a GPU); where it fails, the first launch builds it."""
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
    """Build Triton's CUDA utility module (once per cache directory) here, for the training process."""
    try:
        from triton.backends.nvidia import driver as nv

        nv.CudaUtils()
    except Exception:  # noqa: BLE001 - no CUDA driver library here: the training process builds it
        pass


def worker_count(n_entries: int) -> int:
    """Compile processes: one per spare core of this process's affinity and CPU quota, at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, quota)
    return max(0, min(n_entries, cores - 1, MAX_WORKERS))


MAX_WORKERS = 4
# a container's CPU quota: cgroup v2 cpu.max ("<quota> <period>", quota "max": none), v1 cfs_quota_us (-1: none)
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"


def cpu_quota() -> int | None:
    """The CPUs a container's cgroup quota allows (rounded up, at least 1), or None (no quota, unreadable).
    Affinity does not show a quota: a container given 2 CPUs of a 64-core host sees 64 cores."""
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


def _start_workers(entries: list[dict], target: tuple, workers: int, with_torch: bool = False):
    """Start ``workers`` compile processes for ``entries`` and ``target`` (backend, arch, warp size), round
    robin, each with a stand-in for torch (``with_torch``: the real one, for bench.precompile_timing); returns
    what ``_wait_workers`` needs, or None (error noted: the preload compiles everything)."""
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
            # each leads its own process group, so that ending it also ends its compiler (ptxas)
            proc = subprocess.Popen(_worker_command(part, target, out, with_torch), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                                    cwd=str(Path(__file__).resolve().parent.parent))
            _procs.append(proc)
            procs.append((proc, out))
        atexit.register(_end, procs=_procs, grace=1.0)  # none outlives this process (a hung one would)
    except Exception as exc:  # noqa: BLE001 - no child processes here
        STATE["errors"].append(f"workers: {type(exc).__name__}: {exc}"[:300])
        return None
    return tmp, procs


def _worker_command(part: Path, target: tuple, out: Path, with_torch: bool = False) -> list[str]:
    """A compile process's command: compile ``part``'s entries for ``target``, write the count to ``out``."""
    import sys

    return [sys.executable, "-m", "solution.precompile", "compile", str(part), "--target",
            ":".join(map(str, target)), "--done", str(out)] + (["--with-torch"] if with_torch else [])


def _wait_workers(tmp, procs, deadline: float | None = None) -> int:
    """Wait for the compile processes until ``deadline`` (then ``give_up``; None: no limit); returns their count."""
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
    """End compile processes with their process groups: SIGTERM, SIGKILL after ``grace`` s; reaped if they
    exit within ``grace`` more (one stuck in the OS kernel is left)."""
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
    """Stop the precompile: compile processes ended, no further preload, STATE["stopped"] = ``reason``, one
    line said. Only the first call acts; returns whether this one did."""
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
    """The thread's body: compile processes (``workers`` > 0) first, then every entry preloaded here.
    Failures counted, never raised; bounded by LIMIT_S. Meanwhile Triton's version key is computed here (a
    hash of its sources and ~100 MB native library, once per process): else the first launch pays it."""
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
    """Start the thread on CUDA (unless $SOLUTION_PRECOMPILE=0) when the manifest has entries for this
    Triton; returns it, or None (the reason said, unless turned off or no GPU)."""
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
    """The thread is still compiling and was not given up."""
    return _thread is not None and _thread.is_alive() and not _stop.is_set()


def contended(since: float) -> bool:
    """Did the in-process preload (it holds the GIL) run at any time from ``since`` (perf_counter) until now?
    The compile processes do not count: each has a core of its own (``worker_count``)."""
    if _thread is None or STATE.get("preload_started_t") is None:
        return False  # nothing started, or only the compile processes are running
    ended = STATE.get("finished_t") or STATE.get("stopped_t")  # given up: it starts no compile any more
    return ended is None or ended >= since


def wait(timeout: float | None = None) -> dict:
    """Wait for the thread; returns STATE. With ``timeout``: at most that long (the thread goes on). Without:
    until LIMIT_S after its start at the latest, then ``give_up``."""
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
    add.add_argument("--replace", action="store_true", help="the log's compiles replace the entries of its "
                     "architecture and Triton version (a complete cold run's record: stale entries dropped)")
    comp = sub.add_parser("compile", help="(a compile process of the background precompile) compile entries "
                          "for a target into Triton's disk cache, no GPU needed")
    comp.add_argument("entries_json", type=Path)
    comp.add_argument("--target", required=True, help="backend:arch:warp_size, e.g. cuda:75:32")
    comp.add_argument("--done", type=Path, help="write {\"done\": N} here")
    comp.add_argument("--with-torch", action="store_true", help="import the real torch (default: a stand-in)")
    args = ap.parse_args(argv)
    if args.cmd == "compile":
        return _compile_main(args)
    log = json.loads(args.compile_log_json.read_text(encoding="utf-8"))
    arch = args.arch or log.get("summary", {}).get("arch")
    version = args.triton or log.get("summary", {}).get("triton")
    if not arch or not version:
        print("error: the log does not say its architecture / Triton version; pass --arch and --triton")
        return 2
    def records():  # this architecture's and Triton version's, as the manifest holds them now
        return {e["specialization_data"] for e in load_manifest(args.manifest)
                if (e["arch"], e["triton"]) == (arch, version)}

    before = records()
    add_to_manifest(args.compile_log_json, arch, version, args.manifest, replace=args.replace)
    after = records()
    print(f"{len(after - before)} specializations added ({arch}, Triton {version}) to {args.manifest or manifest_path()}"
          + (f", {len(before - after)} dropped (not in the log), {len(after)} now" if args.replace else ""))
    return 0


class _StandIn:
    """What a compile process's kernel modules get for each name they take from torch: every attribute, call,
    item and subclass another stand-in. Those modules only define their launchers and autograd classes there;
    the compile reads nothing of torch (``test_precompile``: the same cache keys as with torch)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        return _StandIn(f"{self._name}()")

    def __getitem__(self, key):
        return _StandIn(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object, )

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    """``torch`` or a ``torch.*`` module in a compile process: a package whose every attribute is a stand-in."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")


class _StandInFinder:
    """Serves ``torch`` and every ``torch.*`` module as a ``_StandInModule`` (``install_torch_stand_in``)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        import importlib.machinery

        if name != "torch" and not name.startswith("torch."):
            return None
        return importlib.machinery.ModuleSpec(name, _StandInFinder, is_package=True)

    @staticmethod
    def create_module(spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module) -> None:
        pass


def install_torch_stand_in() -> bool:
    """Make ``import torch`` (and ``torch.*``) in this process give stand-ins, unless torch is imported
    already; returns whether it did. Only for a compile process: it imports our kernel modules and compiles,
    never launches (torch's import is ~40% of its time on the machines measured, docs/PERFORMANCE.md). A
    Triton whose compile needed torch would fail an entry here: counted, and the training process's preload
    compiles it (slower, never another binary: the cache key holds the kernel's source and constexprs)."""
    import sys

    if "torch" in sys.modules:
        return False
    sys.meta_path.insert(0, _StandInFinder)
    return True


def _compile_main(args) -> int:
    if not args.with_torch:
        install_torch_stand_in()
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
