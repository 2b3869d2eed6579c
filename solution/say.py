"""The package's one printer: every line a user sees from solution/ starts with "[solution]" and
also goes to the "solution" logger. ``say_once`` prints a message once per process (a fallback is
never silent and never repeated; revert() forgets what was said)."""
from __future__ import annotations

import logging

from solution import state

log = logging.getLogger("solution")
_SAID: set[str] = state.kept(set())


def say(msg: str) -> None:
    print(f"[solution] {msg}", flush=True)
    log.info(msg)


def say_once(msg: str) -> None:
    if msg not in _SAID:
        _SAID.add(msg)
        say(msg)
