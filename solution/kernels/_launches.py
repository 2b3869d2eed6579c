"""Every launch of our Triton kernels goes through ``launch()`` (``kernel[grid](*args, **kwargs)``),
counted under a name in ``LAUNCHES``, so that 'a solution/ kernel ran' can be checked even in the
CPU interpreter; ``record()`` counts a launch made another way.
"""
from __future__ import annotations

from collections import Counter

LAUNCHES: Counter = Counter()
# Names counted that are not our Triton kernels (PyTorch's kernels, reference code): never reported.
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
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr_function, with Python overhead per
    call: docs/PERFORMANCE.md, "Host time per operation")."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n < 1), as triton.next_power_of_2 gives it for launch
    configurations, without the constexpr_function wrapper's per-call overhead (see ``cdiv``)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()
