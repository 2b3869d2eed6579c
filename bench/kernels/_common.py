"""What the per-op GPU benchmarks share: command line, CUDA check, median timing, per-call profile,
bytes moved and achieved rates (GB/s against a same-size copy, TFLOP/s)."""
from __future__ import annotations

import argparse
import functools
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
    columns, then fwd / fwd+bwd ms, memory saved for backward and peak, fwd+bwd speed-up
    against the group's first (stock) row, and the rates of both timings (fwd_and_fwd_bwd_rates:
    MB moved, GB/s, % of a same-size copy, TFLOP/s when the rows have FLOPs)."""
    flops = any("fwd_TFLOP_s" in r for r in results)
    rate_head = ["MB", "GB/s", "% of a same-size copy"] + (["TFLOP/s"] if flops else [])
    head = [h for h, _ in id_cols] + ["fwd ms", "fwd+bwd ms", "saved for bwd MiB", "peak fwd+bwd MiB",
                                       "speedup fwd+bwd"]
    head += [f"{p} {h}" for p in ("fwd", "fwd+bwd") for h in rate_head]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---" for _ in id_cols) + " |" + " ---: |" * (len(head) - len(id_cols)))
    for i, r in enumerate(results):
        base = results[i - i % group]["fwd_bwd_ms"]
        cells = [str(r[k]) for _, k in id_cols]
        cells += [f"{r['fwd_ms']:.4f}", f"{r['fwd_bwd_ms']:.4f}", f"{r['saved_for_bwd_MiB']:.2f}",
                  f"{r['peak_fwd_bwd_MiB']:.2f}", f"{base / r['fwd_bwd_ms']:.2f}x"]
        for p in ("fwd_", "fwd_bwd_"):
            cells += [f"{r[p + 'bytes'] / 1e6:.1f}"] + rate_cells(r, p, flops)
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


def nbytes(*tensors) -> int:
    """Bytes of these tensors (numel * element_size each; None skipped): what reading each once, or
    writing each once, moves. A tensor listed twice counts twice (e.g. read in the forward and
    again in the backward, or an input and its gradient of the same shape)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@functools.lru_cache(maxsize=None)
def same_size_copy_ms(n_bytes: int) -> float:
    """Median ms of a device-to-device copy moving ``n_bytes`` (``dst.copy_(src)`` of uint8 tensors
    of n_bytes / 2 each: half read, half written): the achievable time for an op that must move
    that many bytes, fairer than a 512 MiB copy's bandwidth at a few MB, which launch and tail
    dominate. Cached per byte count, so stock and ours (the same bytes) share one timing; short
    warm-up and repetition windows, so that it costs little of a script's time budget."""
    import triton

    src = torch.empty(max(n_bytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=20, return_mode="median")


def rates(n_bytes: int, ms: float, flops: float | None = None, prefix: str = "") -> dict:
    """The achieved rates of a timing of ``ms`` that must move ``n_bytes`` (and do ``flops``):
    {prefix}bytes, {prefix}GB_s = bytes / time, {prefix}same_size_copy_ms, {prefix}pct_of_same_size_copy
    = copy time / our time in % (100% = as fast as a copy of the same bytes), and with flops
    {prefix}TFLOP_s = flops / time."""
    copy_ms = same_size_copy_ms(int(n_bytes))
    per_s = 1e3 / ms if ms > 0 else float("nan")  # a net time (e.g. clone subtracted) can come out <= 0
    res = {f"{prefix}bytes": int(n_bytes), f"{prefix}GB_s": n_bytes * per_s / 1e9,
           f"{prefix}same_size_copy_ms": copy_ms, f"{prefix}pct_of_same_size_copy": 100 * copy_ms * per_s / 1e3}
    if flops is not None:
        res[f"{prefix}TFLOP_s"] = flops * per_s / 1e12
    return res


def fwd_and_fwd_bwd_rates(row: dict, fwd_bytes: int, bwd_bytes: int, fwd_flops: float | None = None,
                          bwd_flops: float | None = None, fwd_bwd_ms_key: str = "fwd_bwd_ms") -> dict:
    """``row`` (with fwd_ms and fwd_bwd_ms) plus the rates of both timings: fwd_* from the forward's
    bytes (and FLOPs), fwd_bwd_* from forward + backward's sum (the backward is not timed alone)."""
    both = None if fwd_flops is None else fwd_flops + (bwd_flops or 0)
    row.update(rates(fwd_bytes, row["fwd_ms"], fwd_flops, "fwd_"))
    row.update(rates(fwd_bytes + bwd_bytes, row[fwd_bwd_ms_key], both, "fwd_bwd_"))
    return row


def nf4_weight_tensors(weight) -> list:
    """What a pass over a bitsandbytes ``Params4bit`` weight must read: the packed 4-bit codes, the
    per-block absmax and the code table, and with double quantization the second level's absmax,
    code table and offset."""
    qs = weight.quant_state
    ts = [weight.data, qs.absmax, qs.code]
    if getattr(qs, "state2", None) is not None:
        ts += [qs.state2.absmax, qs.state2.code]
    if torch.is_tensor(getattr(qs, "offset", None)):
        ts.append(qs.offset)
    return ts


def causal_attention_flops(lengths, heads: int, head_dim: int) -> float:
    """FLOPs of causal attention's forward over rows of these lengths: per row and head, QK^T and
    PV are 2 * L * L * D each, halved by the causal mask: 4 * H * L^2 * D / 2 (for a padded batch
    of B rows of S: 4 * B * H * S^2 * D / 2). The backward (dQ, dK, dV and the recomputed scores:
    five matmuls where the forward has two) is counted as 2.5x the forward."""
    return 4 * heads * head_dim * sum(n * n for n in lengths) / 2


ATTN_BWD_OVER_FWD = 2.5  # backward FLOPs / forward FLOPs (causal_attention_flops)


def rate_cells(r: dict, prefix: str = "", flops: bool = False) -> list[str]:
    """Table cells "GB/s | % of a same-size copy" [+ "TFLOP/s"] of a ``rates`` result in ``r``."""
    cells = [f"{r[prefix + 'GB_s']:.0f}", f"{r[prefix + 'pct_of_same_size_copy']:.0f}%"]
    if flops:
        t = r.get(prefix + "TFLOP_s")
        cells.append("" if t is None else f"{t:.1f}")
    return cells


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
