"""How fast the host of one run is at what an eager training step's host time is made of: a fixed
probe timed before Soup starts, in every bench.run_one pass (result.json: "host_probe").

Why: on the lent machine the host's speed moves between calls and within one (the baseline's shipped
steps 3-64 took 7.45 s in one call and 14.8 s in another, the same code and data).
Every host-bound step follows it, so a solution / baseline ratio means what it says only where both
passes had the same host. The probe puts a number on each pass's host; the report shows it beside
the run's figures (bench/report.py, column "host probe (us a call)").

What is timed: ``CALLS`` calls of each of two operations on a small tensor of the run's device,
``ROUNDS`` times: allocating it (``torch.empty``) and launching an elementwise op on it
(``add_``), the two things an eager step does most. No device sync inside a round: on a GPU this is
host time (each launch's GPU work, ~2 us, is shorter than its host side). The figure, ``us_per_call``,
is the mean of the two operations' medians over the rounds, in microseconds: lower is a faster host.
About 0.1 s on the H200's host; on a CPU-only machine it times the same operations on CPU tensors.
It measures the host, not our code: both variants run the same probe before anything is patched.
"""
from __future__ import annotations

import statistics
import time

CALLS = 2000
ROUNDS = 5
NUMEL = 256


def probe(device=None) -> dict:
    """{"device": "cuda" or "cpu", "empty_us", "launch_us", "us_per_call"} for ``device`` (default:
    the current CUDA device, else the CPU)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    x = torch.zeros(NUMEL, device=dev)

    def allocate():
        for _ in range(CALLS):
            torch.empty(NUMEL, device=dev)

    def launch():
        for _ in range(CALLS):
            x.add_(1.0)

    out = {"device": dev.type}
    for key, fn in (("empty_us", allocate), ("launch_us", launch)):
        fn()  # warm: the allocator's block and the kernel exist before the first timed round
        rounds = []
        for _ in range(ROUNDS):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
        out[key] = statistics.median(rounds)
    if cuda:
        torch.cuda.synchronize(dev)
        del x
        torch.cuda.empty_cache()  # the probe's block back, so no run's reserved memory counts it
    out["us_per_call"] = (out["empty_us"] + out["launch_us"]) / 2
    return out
