"""What the background precompile (solution/precompile.py) costs on this machine's CPUs, each measurement in an
empty Triton cache: one compile process timed in parts (its start and imports, Triton's CUDA utility module, each
recorded entry, its C launcher's build apart), then the precompile's own compile processes, N at a time, over the same entries.

    python -m bench.precompile_timing [--arch 75] [--processes 1,4] [--torch stand-in,real] [--limit N] [--json FILE]

No GPU needed: a compile targets an architecture (default sm_75, the T4's), not a device; without a CUDA
driver library the utility module is not built (its time is then ~0). The entries are the shipped manifest's
for this Triton (``entries_for``), as apply() would compile them. Figures: docs/PERFORMANCE.md, "Cold start".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from solution import settings

ROOT = Path(__file__).resolve().parent.parent

# One compile process in parts; argv: arch, entries file. Prints one JSON line.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from solution import precompile
if sys.argv[3] == "stand-in":
    precompile.install_torch_stand_in()  # as the precompile's compile processes
else:
    import torch
import triton
from triton.backends.compiler import GPUTarget
launchers = []  # the C launcher builds inside each compile (gcc; only where the CUDA driver library is found)
build = precompile._build_launcher
def timed_build(*a):
    t = time.perf_counter()
    build(*a)
    launchers.append(time.perf_counter() - t)
precompile._build_launcher = timed_build
t1 = time.perf_counter()
precompile._build_driver_utils()
t2 = time.perf_counter()
target = GPUTarget("cuda", int(sys.argv[1]), 32)
times = []
for e in json.load(open(sys.argv[2], encoding="utf-8")):
    a = time.perf_counter()
    precompile.compile_record(precompile.resolve_kernel(e["kernel"]), e["specialization_data"], target)
    times.append([e["kernel"].rsplit(".", 1)[-1], time.perf_counter() - a])
print(json.dumps({"imports_s": t1 - t0, "utils_s": t2 - t1, "compiles": times, "launchers_s": sum(launchers)}))
"""


def one_process(entries: list[dict], arch: int, torch_mode: str = "stand-in") -> dict:
    """One compile process over ``entries`` in an empty cache: wall time and its parts; ``torch_mode``
    "stand-in" (as shipped) or "real" (the real torch imported)."""
    with tempfile.TemporaryDirectory(prefix="precompile-timing-") as tmp:
        path = Path(tmp) / "entries.json"
        path.write_text(json.dumps(entries), encoding="utf-8")
        t = time.perf_counter()
        # as the precompile's own processes: for the GPU target, never the interpreter; solution/ from cwd
        env = {**settings.child_environ(drop=("TRITON_INTERPRET",)), "TRITON_CACHE_DIR": str(Path(tmp) / "cache")}
        out = subprocess.run([sys.executable, "-c", _CHILD, str(arch), str(path), torch_mode], env=env,
                             capture_output=True, text=True, check=True, cwd=str(ROOT))
        wall = time.perf_counter() - t
    parts = json.loads(out.stdout.strip().splitlines()[-1])
    compiles = sum(s for _, s in parts["compiles"])
    return {"arch": arch, "torch": torch_mode, "entries": len(entries), "wall_s": wall, "imports_s": parts["imports_s"],
            "utils_s": parts["utils_s"], "compiles_s": compiles, "launchers_s": parts["launchers_s"],
            "start_s": wall - parts["imports_s"] - parts["utils_s"] - compiles,
            "slowest": sorted(parts["compiles"], key=lambda c: -c[1])[:3]}


def processes(entries: list[dict], arch: int, n: int, torch_mode: str = "stand-in") -> dict:
    """The precompile's own compile processes (``_start_workers``), ``n`` of them, in an empty cache."""
    from solution import precompile

    # the workers inherit this process's environment: an empty cache for them alone
    with tempfile.TemporaryDirectory(prefix="precompile-timing-") as tmp, \
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": str(Path(tmp) / "cache")}):
        t = time.perf_counter()
        started = precompile._start_workers(entries, ("cuda", arch, 32), workers=n,
                                            with_torch=torch_mode == "real")
        done = precompile._wait_workers(*started) if started else 0
        wall = time.perf_counter() - t
    return {"arch": arch, "torch": torch_mode, "processes": n, "entries": len(entries), "compiled": done, "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="75", help="architectures, comma-separated (default 75: the T4)")
    ap.add_argument("--processes", default=None, help="counts of compile processes, comma-separated "
                    "(default: 1 and what apply() would start here)")
    ap.add_argument("--torch", default="stand-in", help="stand-in (as shipped), real, or both in turn: "
                    "stand-in,real (each measurement of one in turn with the other)")
    ap.add_argument("--limit", type=int, default=None, help="the first N entries only")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args(argv)
    try:
        archs = [int(a) for a in args.arch.split(",")]
        counts = None if args.processes is None else [int(n) for n in args.processes.split(",")]
    except ValueError:
        print("error: --arch and --processes take comma-separated integers, e.g. --arch 75,90 --processes 1,4")
        return 2
    modes = args.torch.split(",")
    if not modes or set(modes) - {"stand-in", "real"}:
        print("error: --torch takes stand-in, real or both comma-separated, e.g. --torch stand-in,real")
        return 2
    if counts is not None and min(counts) < 1:
        print("error: --processes counts must be at least 1")
        return 2
    import triton

    from solution import precompile

    entries = precompile.entries_for(precompile.load_manifest(), triton.__version__)[:args.limit]
    if not entries:
        print(f"error: the manifest has no entries usable with Triton {triton.__version__}")
        return 2
    workers = precompile.worker_count(len(entries))
    counts = counts or sorted({1, max(1, workers)})
    res = {"triton": triton.__version__, "cpus": len(os.sched_getaffinity(0)), "quota": precompile.cpu_quota(),
           "worker_count": workers, "one_process": [], "processes": []}
    print(f"precompile timing: {len(entries)} entries (Triton {res['triton']}), {res['cpus']} CPUs here "
          f"(quota {res['quota']}); apply() would start {res['worker_count']} compile process(es)")
    for arch in archs:
        for mode in modes:
            r = one_process(entries, arch, mode)
            res["one_process"].append(r)
            slow = ", ".join(f"{k} {s:.2f}" for k, s in r["slowest"])
            print(f"  one process, sm_{arch}, torch {mode}: {r['wall_s']:.2f} s wall = start {r['start_s']:.2f} + "
                  f"imports {r['imports_s']:.2f} + CUDA utils {r['utils_s']:.2f} + compiles {r['compiles_s']:.2f} "
                  f"(of which C launchers {r['launchers_s']:.2f}; slowest: {slow})")
        for n in counts:
            for mode in modes:
                p = processes(entries, arch, n, mode)
                res["processes"].append(p)
                print(f"  {n} compile process(es), sm_{arch}, torch {mode}: {p['wall_s']:.2f} s wall, "
                      f"{p['compiled']} compiled")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
