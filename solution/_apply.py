"""apply() / revert(): install our kernels into the stock libraries, or take them out again."""
from __future__ import annotations

import importlib
import logging

from solution.env import check_support
from solution.patches import PATCHES
from solution.patches._base import Swaps

log = logging.getLogger("solution")

_swaps = Swaps()
_installed: dict[str, str] = {}


def _say(msg: str) -> None:
    print(f"[solution] {msg}", flush=True)
    log.info(msg)


def apply(verbose: bool = True) -> dict[str, str]:
    """Install every patch this environment supports. Idempotent.

    Returns {patch name: description} of what is installed. On an unsupported environment (no
    CUDA and no interpreter, no Triton, GPU older than sm_75, another model architecture...) it
    installs nothing for the affected part, prints why, and training runs the stock path.
    """
    if _installed:
        return dict(_installed)
    support = check_support()
    if not support.ok:
        _say(f"falling back to the stock path: {support.reason}")
        return {}
    if verbose:
        _say(f"kernels run on: {support.reason}")
    for module_name in PATCHES:
        module = importlib.import_module(module_name)
        reason = module.check()
        if reason is not None:
            _say(f"skip {module.NAME}: {reason} (stock path kept)")
            continue
        before = len(_swaps)
        try:
            desc = module.install(_swaps)
        except Exception as exc:  # never leave a half-installed patch behind
            _partial_restore(before)
            _say(f"skip {module.NAME}: install failed ({type(exc).__name__}: {exc}); stock path kept")
            continue
        _installed[module.NAME] = desc
        if verbose:
            _say(f"installed {module.NAME}: {desc}")
    return dict(_installed)


def _partial_restore(keep: int) -> None:
    extra = Swaps()
    extra._log = _swaps._log[keep:]
    del _swaps._log[keep:]
    extra.restore()


def revert() -> None:
    """Restore every patched object to the stock one. Safe to call when nothing is installed."""
    _swaps.restore()
    _installed.clear()


def installed() -> dict[str, str]:
    return dict(_installed)
