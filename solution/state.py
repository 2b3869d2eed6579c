"""The process state the solution keeps between calls, in one registry that revert() clears.

Plans, caches, decisions and "said once" records live in module-level containers (dicts, sets,
lists, weak dictionaries keyed by a model or a module). Each is created through ``kept(...)``, and
module-level values that are not containers are reset through ``on_clear(fn)``. ``clear()``
(called by revert()) empties them all, so that ``revert()`` then ``apply(settings=...)`` on the
same model builds every plan again under the new settings, and no solution object stays
reachable through them.
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
