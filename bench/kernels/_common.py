"""What the per-op GPU benchmarks share: command line, CUDA check, median timing, per-call profile."""
from __future__ import annotations

import argparse
import sys

import torch


def bench_args(doc: str) -> argparse.Namespace | None:
    """Parse `--out FILE` (the JSON to write). Returns None, after saying so, without CUDA."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    return args


def _x(v) -> str:
    """A speed-up for a table cell ('' when unknown)."""
    return "" if v is None else f"{v:.2f}x"


def _f(v, fmt) -> str:
    """A number for a table cell ('n/a' when unknown)."""
    return "n/a" if v is None else format(v, fmt)


def profile_cells(p: dict) -> str:
    """The table cells "host ms | GPU ops | GPU ms | our launches" of a ``profile_call`` result."""
    return f"{p['host_ms']:.3f} | {_f(p['gpu_ops'], '.1f')} | {_f(p['gpu_ms'], '.4f')} | {p['our_launches']}"


def print_stock_vs_ours(results: list[dict], id_cols: list[tuple[str, str]], group: int = 2) -> None:
    """Markdown table of (stock, ours[, more variants]) row groups of ``group`` rows: the identity
    columns, then fwd / fwd+bwd ms, memory saved for backward and peak, and fwd+bwd speed-up
    against the group's first (stock) row."""
    head = [h for h, _ in id_cols] + ["fwd ms", "fwd+bwd ms", "saved for bwd MiB", "peak fwd+bwd MiB",
                                       "speedup fwd+bwd"]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in id_cols) + " | ---: | ---: | ---: | ---: | ---: |")
    for i, r in enumerate(results):
        base = results[i - i % group]["fwd_bwd_ms"]
        cells = [str(r[k]) for _, k in id_cols]
        cells += [f"{r['fwd_ms']:.4f}", f"{r['fwd_bwd_ms']:.4f}", f"{r['saved_for_bwd_MiB']:.2f}",
                  f"{r['peak_fwd_bwd_MiB']:.2f}", f"{base / r['fwd_bwd_ms']:.2f}x"]
        print("| " + " | ".join(cells) + " |")


def autocast_fwd_and_fwd_bwd(fn, x, g):
    """(fwd, fwd_bwd) closures timing ``fn(x)`` under fp16 autocast, as the training step runs it:
    forward alone without grad, and forward + backward with upstream gradient ``g``."""

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            fn(x)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.float16):
            y = fn(x)
        y.backward(g)

    return fwd, fwd_bwd


def median_ms(fn, **kw):
    """Median time of ``fn`` in ms (triton.testing.do_bench, events)."""
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median", **kw)


def profile_call(fn, reset=(), reps: int = 20) -> dict:
    """Per call of ``fn`` (reset: tensors whose .grad is cleared before each call):
    host_ms: median wall time of the Python call with the GPU idle before it, i.e. the CPU cost of
             issuing the work (Python, torch dispatch, launches); when it exceeds the GPU time the
             call is host-bound and do_bench measures it rather than the kernels;
    gpu_ops, gpu_ms: work items the GPU ran (kernels, memsets, copies) and their summed time, from
             torch.profiler; our_launches: our Triton launches (solution.kernels._launches)."""
    import statistics
    import time

    from solution.kernels import _launches

    def call():
        for t in reset:
            t.grad = None
        fn()

    call()
    torch.cuda.synchronize()
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    _launches.reset()
    call()
    res = {"host_ms": statistics.median(host) * 1e3, "our_launches": sum(_launches.LAUNCHES.values()),
           "gpu_ops": None, "gpu_ms": None}
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call()
            torch.cuda.synchronize()
        evs = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        res["gpu_ops"] = sum(e.count for e in evs) / reps
        res["gpu_ms"] = sum((getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))
                            for e in evs) / reps / 1e3
    except Exception as exc:  # no CUPTI etc.: the timings above still stand
        res["profiler_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return res
