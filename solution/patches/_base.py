"""Swap attributes, remember the originals, restore them. A patch is a module in solution/patches/ with:
    NAME: str                      short name printed by apply()
    def check() -> str | None      None when the patch can be installed here, else the reason
    def install(swaps: Swaps) -> str   installs through ``swaps.set(...)``; returns a one-line description
"""
from __future__ import annotations

from typing import Any

_MISSING = object()


class Swaps:
    """Records (owner, attribute, original): ``restore()`` puts back every original object exactly."""

    def __init__(self) -> None:
        self._log: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, new: Any) -> None:
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        self._log.append((owner, name, original))
        setattr(owner, name, new)

    def restore(self) -> None:
        for owner, name, original in reversed(self._log):
            if original is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
        self._log.clear()

    def __len__(self) -> int:
        return len(self._log)
