"""Compile our Triton kernels before their first launch, in a background thread that apply()
starts, from specializations recorded earlier on the same GPU architecture with the same Triton.

What it replaces: today Triton compiles each of our kernels the first time training launches it,
one after the other inside the first step (~9 s on the H200 from a cold cache, against the
baseline's ~0.9 s first step; docs/PERFORMANCE.md). Soup spends several seconds loading and
quantizing the model after apply() and before that first step.

What it does instead: ``bench.run_one --compile-log`` records, through Triton's compile hooks,
Triton's own serialized specialization of every compile of a run (argument types, alignment
attributes, constexprs, options and the JIT cache key). ``python -m solution.precompile add
compiles.json`` keeps those of our kernels in ``solution/kernels/compile_manifest.json``, tagged
with the GPU architecture and Triton version they were recorded with. With
$SOLUTION_PRECOMPILE=1, apply() starts a daemon thread that calls Triton's
``JITFunction.preload(data)`` for every entry of this machine's architecture and Triton version:
the kernel is compiled into the JIT's cache under the recorded key, so the first launch finds it.
No tensors, no launches, no random numbers, no GPU memory: only compilation.

Risks: an entry recorded elsewhere (another architecture, Triton version or launch configuration)
compiles something the run never launches: wasted background CPU, nothing else (entries are
filtered by architecture and version first). A preload that fails is counted and reported, never
raised. The thread competes with Soup's model loading for the CPU (Python parts of the compile
hold the GIL). If training reaches a kernel before the thread did, Triton compiles it as today.

Off by default and not measured yet: the manifest has to be recorded on a GPU first (docs/NOTES.md).
"""
from __future__ import annotations

import importlib
import json
import os
import threading
import time
from pathlib import Path

ENV = "SOLUTION_PRECOMPILE"
MANIFEST_ENV = "SOLUTION_PRECOMPILE_MANIFEST"  # another manifest file (measurements: a scratch one)
MANIFEST = Path(__file__).resolve().parent / "kernels" / "compile_manifest.json"
OWN_PREFIX = "solution.kernels."

STATE: dict = {"started": False, "entries": 0, "done": 0, "failed": 0, "seconds": None, "errors": []}
_thread: threading.Thread | None = None


def requested() -> bool:
    return os.environ.get(ENV, "0") == "1"


def manifest_path() -> Path:
    return Path(os.environ.get(MANIFEST_ENV) or MANIFEST)


def load_manifest(path: Path | None = None) -> list[dict]:
    """The manifest's entries ([] when there is none). Raises ValueError for a malformed file."""
    path = manifest_path() if path is None else path
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["entries"]
        for e in entries:
            if not all(isinstance(e.get(k), str) for k in ("arch", "triton", "kernel", "specialization_data")):
                raise KeyError("arch / triton / kernel / specialization_data")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a compile manifest ({type(exc).__name__}: {exc})") from exc
    return entries


def entries_for(entries: list[dict], arch: str, triton_version: str) -> list[dict]:
    """The entries recorded on this architecture (e.g. "sm_75") with this Triton version."""
    return [e for e in entries if e["arch"] == arch and e["triton"] == triton_version]


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


def run(entries: list[dict]) -> None:
    """Preload every entry (the background thread's body); failures are counted, never raised."""
    t0 = time.perf_counter()
    for e in entries:
        fn = resolve_kernel(e["kernel"])
        try:
            if fn is None:
                raise LookupError(f"no @triton.jit kernel {e['kernel']}")
            fn.preload(e["specialization_data"])
            STATE["done"] += 1
        except Exception as exc:  # noqa: BLE001 - a failed preload only means a compile at first use
            STATE["failed"] += 1
            if len(STATE["errors"]) < 5:
                STATE["errors"].append(f"{e['kernel']}: {type(exc).__name__}: {exc}"[:300])
    STATE["seconds"] = time.perf_counter() - t0


def start(device: str, say=print) -> threading.Thread | None:
    """Start the background preload when $SOLUTION_PRECOMPILE=1 and the manifest has entries for
    this GPU and Triton; returns the thread (None when nothing starts, with the reason said)."""
    global _thread
    if not requested():
        return None
    if device != "cuda":
        say(f"{ENV}=1 ignored: precompiling needs a CUDA GPU (kernels run on {device})")
        return None
    if _thread is not None:
        return _thread
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability()
    arch, version = f"sm_{major}{minor}", triton.__version__
    try:
        entries = entries_for(load_manifest(), arch, version)
    except ValueError as exc:
        say(f"{ENV}=1 ignored: {exc}")
        return None
    if not entries:
        say(f"{ENV}=1: no recorded specializations for {arch} with Triton {version} in {manifest_path()}; "
            "kernels compile at first use")
        return None
    STATE.update(started=True, entries=len(entries), done=0, failed=0, seconds=None, errors=[])
    _thread = threading.Thread(target=run, args=(entries,), name="solution-precompile", daemon=True)
    _thread.start()
    say(f"precompiling {len(entries)} kernel specializations in the background ({arch}, Triton {version})")
    return _thread


def wait(timeout: float | None = None) -> dict:
    """Wait for the background preload (tests, diagnosis); returns STATE."""
    if _thread is not None:
        _thread.join(timeout)
    return dict(STATE)


def add_to_manifest(compile_log_json: Path, arch: str, triton_version: str, path: Path | None = None) -> int:
    """Add our kernels' compiles from a compile log (bench/compile_log.py's .json) to the manifest,
    tagged with ``arch`` and ``triton_version``; duplicates are dropped. Returns how many were added."""
    log = json.loads(Path(compile_log_json).read_text(encoding="utf-8"))
    path = manifest_path() if path is None else path
    entries = load_manifest(path)
    seen = {(e["arch"], e["triton"], e["kernel"], e["specialization_data"]) for e in entries}
    added = 0
    for row in log.get("compiles", []):
        kernel, data = row.get("kernel"), row.get("specialization_data")
        if not (isinstance(kernel, str) and kernel.startswith(OWN_PREFIX) and isinstance(data, str)):
            continue
        k = (arch, triton_version, kernel, data)
        if k not in seen:
            seen.add(k)
            entries.append({"arch": arch, "triton": triton_version, "kernel": kernel, "specialization_data": data})
            added += 1
    path.write_text(json.dumps({"entries": entries}, indent=1) + "\n", encoding="utf-8")
    return added


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Add a run's recorded compiles of our kernels to the manifest.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="add the compiles of a compile log (.json) to the manifest")
    add.add_argument("compile_log_json", type=Path)
    add.add_argument("--arch", help="GPU architecture it was recorded on, e.g. sm_75 (default: the log's)")
    add.add_argument("--triton", help="Triton version it was recorded with (default: the log's)")
    add.add_argument("--manifest", type=Path, default=None, help=f"default: ${MANIFEST_ENV} or {MANIFEST}")
    args = ap.parse_args(argv)
    log = json.loads(args.compile_log_json.read_text(encoding="utf-8"))
    arch = args.arch or log.get("summary", {}).get("arch")
    version = args.triton or log.get("summary", {}).get("triton")
    if not arch or not version:
        print("error: the log does not say its architecture / Triton version; pass --arch and --triton")
        return 2
    n = add_to_manifest(args.compile_log_json, arch, version, args.manifest)
    print(f"added {n} specializations ({arch}, Triton {version}) to {args.manifest or manifest_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
