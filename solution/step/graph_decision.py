"""Whether the decoder CUDA graphs pay on this machine ($SOLUTION_CUDA_GRAPHS=auto; docs/cuda_graphs.md, 3a).

A replay removes host work, never GPU work. The first packed training forward runs eagerly; its layers'
second half (the first pays the first step's compiles) is timed on the host and on the GPU (CUDA events read
at the next step: no extra sync). GPU time within GPU_BOUND_RATIO of the host's: host-bound, graphs from the
next step on; else no graphs. A sample that overlapped the precompile's in-process preload (it holds the GIL)
is not used, and a timed part waits for that preload first (``settle_precompile``).
"""
from __future__ import annotations

import time
import weakref

import torch

from solution import precompile, state
from solution.say import say

DECISIONS: list[dict] = []  # {"graphs", "reason", "samples"} per model decided, in this process

GPU_BOUND_RATIO = 1.15


_MEANING = {
    False: "a replay saves host time only, and its filler tokens add GPU work",
    True: "the GPU waits for the host's launches",
}


def decide(samples: list[tuple[float, float]]) -> tuple[bool | None, str]:
    """(host-bound = graphs on?, why) from the samples (host s, GPU s) so far; None while there is none. Pure."""
    if not samples:
        return None, "measuring"
    host, gpu = samples[0]
    ratio = gpu / host if host > 0 else float("inf")
    figures = f"layers' second half: host {host * 1e3:.1f} ms, GPU {gpu * 1e3:.1f} ms ({ratio:.2f}x)"
    verdict = ratio <= GPU_BOUND_RATIO
    return verdict, f"{'host-bound' if verdict else 'GPU-bound'} ({figures}): {_MEANING[verdict]}"


def decision_line(d: dict) -> str:
    """One line for a DECISIONS entry (said when it is made; bench/report.py prints it too)."""
    return f"decoder CUDA graphs {'on' if d['graphs'] else 'off'}: {d['reason']}"


PRECOMPILE_WAIT_S = 30.0  # the most the first timed forward waits for the precompile's in-process preload


def settle_precompile(timeout: float = PRECOMPILE_WAIT_S) -> float:
    """Before a probe sample: wait (at most ``timeout`` s) for the precompile's in-process preload to end, so
    that it cannot void the sample and delay the decision (docs/cuda_graphs.md, 5b); not for the compile
    processes, which do not void one. Returns the seconds waited."""
    if not precompile.running() or precompile.STATE.get("preload_started_t") is None:
        return 0.0
    t0 = time.perf_counter()
    precompile.wait(timeout)
    return time.perf_counter() - t0


class Timer:
    """Times one eager forward's layers from ``start()`` to ``stop()`` for a Probe (host and GPU)."""

    def __init__(self, probe: "Probe", device):
        self.probe, self.stream = probe, torch.cuda.current_stream(device)
        self.t0, self.start_ev = None, torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        settle_precompile()
        self.start_ev.record(self.stream)
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.t0 is None:
            return
        host = time.perf_counter() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        if not precompile.contended(self.t0):  # the in-process preload competed for the host: not a clean sample
            self.probe.pending.append((host, self.start_ev, end))


class Probe:
    """The eager steps of one model timed for ``decide`` (see above)."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.pending: list[tuple] = []  # (host s, start event, end event)
        self.verdict: bool | None = None
        self.reason = "measuring"

    def collect(self) -> None:
        """Read the completed events of earlier steps, then decide if possible (said, kept in DECISIONS)."""
        while self.pending and self.pending[0][2].query():
            host, start, end = self.pending.pop(0)
            self.samples.append((host, start.elapsed_time(end) / 1e3))
        if self.verdict is None:
            self.verdict, self.reason = decide(self.samples)
            if self.verdict is not None:
                DECISIONS.append({"graphs": bool(self.verdict), "reason": self.reason, "samples": list(self.samples)})
                say(decision_line(DECISIONS[-1]))


_PROBES: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())  # model -> Probe


def probe_of(model, device: torch.device, wanted: bool) -> Probe | None:
    """The model's probe when this forward needs its verdict (``wanted``: "auto", not refused; CUDA), else None."""
    if device.type != "cuda" or not wanted:
        return None
    probe = _PROBES.get(model)
    if probe is None:
        probe = _PROBES[model] = Probe()
    return probe


def eager_timer(model, device: torch.device) -> Timer | None:
    """A timer for the caller's eager loop while "auto" still measures this model and no sample is pending."""
    probe = _PROBES.get(model)
    if probe is None or probe.verdict is not None or probe.pending or device.type != "cuda":
        return None
    return Timer(probe, device)
