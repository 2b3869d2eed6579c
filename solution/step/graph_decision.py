"""Whether the decoder CUDA graphs pay on this machine ($SOLUTION_CUDA_GRAPHS=auto): the measured decision.

A graph replay removes host work (Python and launches), never GPU work: it pays only where the
eager layers keep the GPU waiting for the host. On a GPU-bound machine (a T4 may be one) a
capture is pure cost and the bucket's filler tokens add GPU work. So in "auto" mode the first
packed training forward runs eagerly and its second half of layers is timed: host time from
the call of layer L/2 to the return of the last layer (time.perf_counter), GPU time between
two CUDA events recorded at the same two points (read at the next step, when the step's own
synchronisation has completed them: no extra sync). The first half is left out: it pays the
compiles and lazy initialisations of a first step, which would make any machine look
host-bound. If the GPU finished that work within GPU_BOUND_RATIO of the host's time, the GPU was
waiting for the host (host-bound): graphs from the next step on. Otherwise it was still busy
after the host had issued everything (GPU-bound): no graphs. A sample during which the
background precompile's in-process preload ran (it holds the GIL) is not used; the next step
is timed instead. Its compile processes still running do not void a sample: each has its own
core. (Voiding those too put a cold run's captures into step 3, inside the timed steps:
docs/cuda_graphs.md, section 5b.) And a timed part does not start during the preload
(``settle_precompile`` waits for its end), so that the first step's sample is a clean one.
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
    """(host-bound?, why) from the probe samples so far, (host seconds, GPU seconds) of the eager
    layers' timed part per step; None while there is none. Host-bound means graphs on. Pure: tested
    with fake timings."""
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
    """Before a probe sample: if the background precompile is in its in-process preload (the
    short last phase: disk hits once the compile processes are done), wait for it to end (at most ``timeout`` seconds), so that it cannot void the sample and
    delay the decision by a step (a late decision put a cold run's captures into the timed steps:
    docs/cuda_graphs.md, section 5b). While the compile processes still run, nothing is waited
    for: they do not void a sample, and on a host with few cores the step compiles what it needs
    sooner than the processes' queue would. Returns the seconds waited."""
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
        """Read the events of earlier steps that have completed, then decide if possible (said and
        recorded in DECISIONS)."""
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
    """The model's probe when this forward needs its verdict (``wanted``: graphs in "auto" mode and
    not refused). None otherwise, and without CUDA (no timing there)."""
    if device.type != "cuda" or not wanted:
        return None
    probe = _PROBES.get(model)
    if probe is None:
        probe = _PROBES[model] = Probe()
    return probe


def eager_timer(model, device: torch.device) -> Timer | None:
    """A timer for the caller's eager loop over the layers (it times their second half) while
    "auto" mode is still measuring this model and no sample is waiting to be read; None otherwise
    (nothing to time)."""
    probe = _PROBES.get(model)
    if probe is None or probe.verdict is not None or probe.pending or device.type != "cuda":
        return None
    return Timer(probe, device)
