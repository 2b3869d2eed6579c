"""Every launch of our Triton kernels goes through ``launch()``: one place that starts a kernel and
counts it, so the rule 'at least one solution/ kernel ran during training' can be checked even on
the CPU interpreter, where no GPU profiler sees kernels (counting costs ~50 ns a launch).

Measured and dropped (2026-11-30, H200, Triton 3.6; bench/kernels/bench_launch.py): calling the
compiled kernel's launcher directly instead of ``kernel[grid](...)``. cProfile had put Triton's
launch path at 64 us a launch; measured without the profiler it costs 13.8 us (a torch.add: 7.3 us),
so at ~950 launches a step at most ~9 ms of a ~170-240 ms step could be saved, and the first
version, whose cache key cost more than it saved, measured slower. See docs/NOTES.md.
"""
from collections import Counter

LAUNCHES: Counter = Counter()


def record(kernel_name: str) -> None:
    LAUNCHES[kernel_name] += 1


def reset() -> None:
    LAUNCHES.clear()


def launch(kernel, grid, name: str, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted under ``name``."""
    LAUNCHES[name] += 1
    kernel[grid](*args, **kwargs)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr_function: ~1 us of host time a call)."""
    return -(-a // b)
