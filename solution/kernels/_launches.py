"""Every launch of our Triton kernels goes through ``launch()``: one place that starts a kernel and
counts it, so the rule 'at least one solution/ kernel ran during training' can be checked even on
the CPU interpreter, where no GPU profiler sees kernels (counting costs ~50 ns a launch).

Measured and dropped (2026-11-30, H200, Triton 3.6; bench/kernels/bench_launch.py): calling the
compiled kernel's launcher directly instead of ``kernel[grid](...)``. cProfile had put Triton's
launch path at 64 us a launch; measured without the profiler it costs 13.8 us (a torch.add: 7.3 us),
so at ~950 launches a step at most ~9-15 ms of a ~170-280 ms step could be saved. The first
version never reached its direct path on the GPU (its test showed every launch still going through
Triton, plus its cache key: 21.7 against 13.8 us), so it was dropped rather than debugged.
See docs/PERFORMANCE.md ("Host time per operation") and docs/NOTES.md.
"""
from collections import Counter

LAUNCHES: Counter = Counter()
# Names counted in LAUNCHES that are not our Triton kernels (PyTorch's own kernels or reference
# code run by our wiring): counted for the tests, never reported as our kernels.
NOT_OURS: set = set()


def record(kernel_name: str, ours: bool = True) -> None:
    LAUNCHES[kernel_name] += 1
    if not ours:
        NOT_OURS.add(kernel_name)


def reset() -> None:
    LAUNCHES.clear()


def launch(kernel, grid, name: str, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted under ``name``."""
    LAUNCHES[name] += 1
    kernel[grid](*args, **kwargs)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr_function: ~1 us of host time a call)."""
    return -(-a // b)
