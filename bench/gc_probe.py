"""How much of a run's wall time Python's garbage collector takes (diagnosis only).

    python -m bench.gc_probe [--out FILE] [--gen0 N] -m bench.run_one ARGS...

Runs the module after ``-m`` (with its arguments) in this process, with a ``gc.callbacks`` timer
that adds up the time of every collection, by generation, and writes the totals (collections,
seconds, objects collected) to FILE (default: stdout) at exit. Changes nothing in the run but the
two timer reads per collection. ``--gen0 N``: first set the youngest generation's threshold to N
(Python's default 700), an A/B of how much the collector's frequency costs.
"""
from __future__ import annotations

import atexit
import gc
import json
import runpy
import sys
import time


def main() -> None:
    argv = sys.argv[1:]
    out = None
    if argv[:1] == ["--out"]:
        out, argv = argv[1], argv[2:]
    if argv[:1] == ["--gen0"]:
        gc.set_threshold(int(argv[1]), *gc.get_threshold()[1:])
        argv = argv[2:]
    if argv[:1] != ["-m"] or len(argv) < 2:
        raise SystemExit("usage: python -m bench.gc_probe [--out FILE] -m MODULE ARGS...")
    module, rest = argv[1], argv[2:]
    totals = {g: {"collections": 0, "seconds": 0.0, "collected": 0} for g in (0, 1, 2)}
    start = {}

    def timer(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            t = totals[info["generation"]]
            t["collections"] += 1
            t["seconds"] += time.perf_counter() - start.pop("t", time.perf_counter())
            t["collected"] += info.get("collected", 0)

    def report():
        text = json.dumps({"module": module, "thresholds": gc.get_threshold(), "by_generation": totals}, indent=1)
        if out:
            with open(out, "w") as f:
                f.write(text)
        print("[gc_probe]", text.replace("\n", " "))

    gc.callbacks.append(timer)
    atexit.register(report)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
