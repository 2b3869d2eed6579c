"""The process state the solution keeps between calls, in one registry that revert() clears: every
module-level container of plans, caches, decisions and "said once" records is created through ``kept(...)``,
other module-level values are reset through ``on_clear(fn)``. After ``clear()``, ``apply(settings=...)`` on
the same model builds every plan again, and no solution object stays reachable through them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_KEPT: list = []  # containers with a clear() method
_RESETS: list[Callable[[], None]] = []


def kept(container: T) -> T:
    """Register ``container`` (anything with ``clear()``) and return it."""
    _KEPT.append(container)
    return container


def on_clear(reset: Callable[[], None]) -> Callable[[], None]:
    """Register ``reset`` (no arguments), called by ``clear()``; returns it (usable as a decorator)."""
    _RESETS.append(reset)
    return reset


def clear() -> None:
    """Empty every registered container and run every registered reset."""
    for container in _KEPT:
        container.clear()
    for reset in _RESETS:
        reset()
