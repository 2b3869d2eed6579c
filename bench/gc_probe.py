"""How much of a run's wall time Python's garbage collector takes (diagnosis only).

    python -m bench.gc_probe [--out FILE] [--gen0 N] -m bench.run_one ARGS...

Runs the module after ``-m`` (with its arguments) in this process, with a ``gc.callbacks`` timer
that adds up the time of every collection, by generation, and writes the totals (collections,
seconds, objects collected) to FILE (default: stdout) at exit. Changes nothing in the run but the
two timer reads per collection. ``--gen0 N``: first set the youngest generation's threshold to N
(Python's default 700), an A/B of how much the collector's frequency costs.
"""
from __future__ import annotations

import gc
import json
import sys
import time

from bench import module_probe


def main() -> None:
    opts, module, rest = module_probe.parse(sys.argv[1:], "bench.gc_probe", ("--out", "--gen0"))
    if "--gen0" in opts:
        gc.set_threshold(int(opts["--gen0"]), *gc.get_threshold()[1:])
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
        module_probe.write(opts.get("--out"), text)
        print("[gc_probe]", text.replace("\n", " "))

    gc.callbacks.append(timer)
    module_probe.run(module, rest, report)


if __name__ == "__main__":
    main()
