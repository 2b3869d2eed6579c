"""Which Python line launches each GPU kernel, and what it costs (issue 13.2's tool).

Used by bench/run_one.py --op-origins FILE: torch.profiler records CPU ops with their Python
stacks and the GPU kernels they launch for ORIGIN_STEPS steps from step 3 on, then the ops are
grouped by (aten op, innermost frames) and sorted by the GPU time of their own kernels. The
profile's kernel-name list (bench.compare's "top kernels") says *what* runs; this says *where
from*: e.g. which line's ``.to(torch.float16)`` is the ``float16_copy_kernel`` of the list.

Only PyTorch ops have a row: our Triton kernels are launched without an aten op (they are
named in the profile's kernel list already), and so are the kernels of a graph replay.

Measurement only, in a pass of its own: recording CPU ops with stacks slows the host a lot.
Run it with graphs off (``SOLUTION_CUDA_GRAPHS=0``): a graph replay launches its kernels without
the CPU ops that recorded them, so they would have no origin; the eager layers launch the same
kernels.

    python -m bench.run_one --variant solution ... --op-origins origins.md
"""
from __future__ import annotations

ORIGIN_STEPS = 3  # steps 3..5: enough for every op of a step, short enough for the slow host
STACK_DEPTH = 12  # frames kept per group by the profiler; the table shows the innermost non-torch ones
SHOWN_FRAMES = 3
_PLUMBING = ("/torch/", "torch/", "<built-in", "/contextlib.py", "/functools.py", "<frozen", "/triton/",
             "/typing.py")


def start():
    """Start a profiler of CPU ops (with Python stacks) and the GPU kernels they launch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts, record_shapes=False, with_stack=True)
    prof.__enter__()
    return prof


def _device_self_us(avg) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):  # torch >= 2.4, older
        value = getattr(avg, name, None)
        if value is not None:
            return float(value)
    return 0.0


def origin(stack: list[str]) -> str:
    """The innermost frames of a profiler stack that are not torch / Triton plumbing (the
    checkout's and site-packages' prefixes cut off), innermost first."""
    kept = [fr for fr in stack if not any(p in fr for p in _PLUMBING)]
    short = [fr.split("site-packages/")[-1].split("/work/main/")[-1] for fr in kept[:SHOWN_FRAMES]]
    return " < ".join(short) if short else "(no Python frame)"


def rows_from(averages) -> list[dict]:
    """One row per (aten op, origin) with its kernels' own GPU time: from key_averages grouped
    by stack. Ops that launched no GPU work are left out."""
    rows: dict[tuple[str, str], dict] = {}
    for avg in averages:
        us = _device_self_us(avg)
        if us <= 0:
            continue
        key = (avg.key, origin(list(getattr(avg, "stack", None) or [])))
        row = rows.setdefault(key, {"op": key[0], "origin": key[1], "gpu_ms": 0.0, "calls": 0})
        row["gpu_ms"] += us / 1e3
        row["calls"] += int(getattr(avg, "count", 0))
    return sorted(rows.values(), key=lambda r: -r["gpu_ms"])


def stop(prof, steps: int) -> list[dict]:
    """Stop the profiler; the rows of ``rows_from``, GPU time per step (``steps`` profiled)."""
    prof.__exit__(None, None, None)
    rows = rows_from(prof.key_averages(group_by_stack_n=STACK_DEPTH))
    for r in rows:
        r["gpu_ms"] /= max(steps, 1)
        r["calls"] = r["calls"] / max(steps, 1)
    return rows


def format_rows(rows: list[dict], steps: int, top: int = 50) -> str:
    total = sum(r["gpu_ms"] for r in rows)
    lines = [f"GPU time of the kernels each op launched itself, per step (mean of {steps} profiled steps; "
             f"{total:.2f} ms a step in all ops with an origin)", "",
             "| GPU ms / step | share | calls / step | aten op | launched from (innermost first) |",
             "| ---: | ---: | ---: | --- | --- |"]
    for r in rows[:top]:
        share = r["gpu_ms"] / total if total else 0.0
        lines.append(f"| {r['gpu_ms']:.3f} | {share:.1%} | {r['calls']:.0f} | `{r['op']}` | `{r['origin']}` |")
    rest = rows[top:]
    if rest:
        lines.append(f"| {sum(r['gpu_ms'] for r in rest):.3f} | | | ({len(rest)} more) | |")
    return "\n".join(lines)
