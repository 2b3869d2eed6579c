"""Which Python line launches each GPU kernel, and what it costs.

Used by bench/run_one.py --op-origins FILE: torch.profiler records CPU ops with their Python
stacks and the GPU kernels they launch for ORIGIN_STEPS steps from step 3 on, then the ops are
grouped by (aten op, innermost frames) and sorted by the GPU time of their own kernels. The
profile's kernel-name list (bench.compare's "top kernels") says *what* runs; this says *where
from*: e.g. which line's ``.to(torch.float16)`` is the ``float16_copy_kernel`` of the list.

A row is an op event: its own GPU time is that of the kernels launched inside it and not inside
a child op, so a Triton kernel launched from our autograd Function's forward counts in that
Function's row. The backward's ops run on autograd's own thread with no Python frame; their
origin is the autograd node they ran in ("backward of _LayerNodeBackward"). The kernels of a
graph replay have no op at all.

Measurement only, in a pass of its own: recording CPU ops with stacks slows the host a lot.
Run it with graphs off (``SOLUTION_CUDA_GRAPHS=0``): a graph replay launches its kernels without
the CPU ops that recorded them, so they would have no origin; the eager layers launch the same
kernels.

    python -m bench.run_one --variant solution ... --op-origins origins.md
"""
from __future__ import annotations

import re

ORIGIN_STEPS = 3  # steps 3..5: enough for every op of a step, short enough for the slow host
NO_FRAME = "(no Python frame)"
_MODULE_INDEX = re.compile(r"(nn\.Module: \w+?)_\d+$")  # "nn.Module: Qwen2MLP_21": one row for all 28 layers
# Ops whose kernels are matrix products or attention (format_rows lists the others apart)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::_efficient_attention_forward", "aten::_efficient_attention_backward")
SHOWN_FRAMES = 3
_PLUMBING = ("/torch/", "torch/", "<built-in", "/contextlib.py", "/functools.py", "<frozen", "/triton/",
             "/typing.py")


def start():
    """Start a profiler of CPU ops (with Python stacks) and the GPU kernels they launch.

    ``verbose=True`` is what puts the Python stack on each op's event: without it, recent torch
    (2.11 measured on the H200, 2.13 here) records the Python frames as events of their own and
    leaves every op's ``stack`` empty (a table with no frame at all)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    extra = {}
    try:
        from torch._C._profiler import _ExperimentalConfig

        extra["experimental_config"] = _ExperimentalConfig(verbose=True)
    except (ImportError, TypeError):  # an older torch attaches stacks without it
        pass
    prof = profile(activities=acts, record_shapes=False, with_stack=True, **extra)
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
    short = [_MODULE_INDEX.sub(r"\1", fr.split("site-packages/")[-1].split("/work/main/")[-1])
             for fr in kept[:SHOWN_FRAMES]]
    return " < ".join(short) if short else NO_FRAME


def _is_cpu_op(event) -> bool:
    """An op event (its kernels' time is its own device time), not a kernel event."""
    return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1] == "CPU"


def backward_node(event) -> str | None:
    """The autograd node whose backward ran this op (ops of the backward run on the autograd
    engine's thread, with no Python frame): the nearest ancestor event named after a node."""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        name = getattr(parent, "name", "")
        if name.startswith("autograd::engine::evaluate_function: "):
            return name.split(": ", 1)[1]
        if name.endswith("Backward") or name.endswith("Backward0") or name.endswith("Backward1"):
            return name
        parent = getattr(parent, "cpu_parent", None)
    return None


def rows_from(events) -> list[dict]:
    """One row per (aten op, origin) with its kernels' own GPU time, from the profiler's op
    events (one per call). The origin is the innermost Python frames (``origin``), prefixed with
    "backward of NODE" for an op of the backward. Kernel events and ops that launched no GPU work are left
    out (the kernel's time is its op's own device time already)."""
    rows: dict[tuple[str, str], dict] = {}
    for ev in events:
        if not _is_cpu_op(ev):
            continue
        us = _device_self_us(ev)
        if us <= 0:
            continue
        where = origin(list(getattr(ev, "stack", None) or []))
        node = backward_node(ev)
        if node:  # its frames, if any, are the caller of backward() (or our Function's backward)
            where = f"backward of {node}" + ("" if where == NO_FRAME else f": {where}")
        name = getattr(ev, "name", None) or getattr(ev, "key", "?")
        row = rows.setdefault((name, where), {"op": name, "origin": where, "gpu_ms": 0.0, "calls": 0})
        row["gpu_ms"] += us / 1e3
        row["calls"] += int(getattr(ev, "count", 1) or 1)
    return sorted(rows.values(), key=lambda r: -r["gpu_ms"])


def stop(prof, steps: int) -> list[dict]:
    """Stop the profiler; the rows of ``rows_from``, GPU time per step (``steps`` profiled)."""
    prof.__exit__(None, None, None)
    rows = rows_from(prof.events())
    for r in rows:
        r["gpu_ms"] /= max(steps, 1)
        r["calls"] = r["calls"] / max(steps, 1)
    return rows


_HEADER = ["| GPU ms / step | share | calls / step | aten op | launched from (innermost first) |",
           "| ---: | ---: | ---: | --- | --- |"]


def _table(rows: list[dict], total: float, top: int) -> list[str]:
    out = list(_HEADER)
    for r in rows[:top]:
        share = r["gpu_ms"] / total if total else 0.0
        out.append(f"| {r['gpu_ms']:.3f} | {share:.1%} | {r['calls']:.0f} | `{r['op']}` | `{r['origin']}` |")
    return out


def format_rows(rows: list[dict], steps: int, top: int = 50) -> str:
    """The rows, largest first, then the PyTorch ops that are neither matrix products nor
    attention; shares are of all rows' GPU time."""
    total = sum(r["gpu_ms"] for r in rows)
    lines = [f"GPU time of the kernels each op launched itself, per step (mean of {steps} profiled steps; "
             f"{total:.2f} ms a step in all ops with an origin)", ""] + _table(rows, total, top)
    rest = rows[top:]
    if rest:
        lines.append(f"| {sum(r['gpu_ms'] for r in rest):.3f} | | | ({len(rest)} more) | |")
    others = [r for r in rows if r["op"].startswith("aten::") and r["op"] not in MATMUL_OPS]
    lines += ["", f"PyTorch ops that are not matrix products or attention: "
              f"{sum(r['gpu_ms'] for r in others):.3f} ms a step in {len(others)} rows", ""]
    return "\n".join(lines + _table(others, total, top))
