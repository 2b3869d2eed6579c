"""apply() / revert(): install our kernels into the stock libraries, or take them out again."""
from __future__ import annotations

import importlib
import logging
import os

from solution import precompile
from solution.step import cuda_graphs
from solution.env import check_flags, check_support, memory_policy
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

    Returns {patch name: description} of what is installed; raises ValueError, before installing
    anything, when a setting is invalid (check_settings). On an unsupported environment (no
    CUDA and no interpreter, no Triton, GPU older than sm_75, another model architecture...) it
    installs nothing for the affected part, prints why, and training runs the stock path.
    """
    if _installed:
        return dict(_installed)
    check_settings()  # a bad $SOLUTION_* value is the user's error: raise before touching anything
    support = check_support()
    if not support.ok:
        _say(f"falling back to the stock path: {support.reason}")
        return {}
    if verbose:
        _say(f"kernels run on: {support.reason}")
    skip = skipped_patches()
    for module_name in PATCHES:
        module = importlib.import_module(module_name)
        reason = f"listed in {SKIP_ENV}" if module.NAME in skip else module.check()
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
    if _installed:
        precompile.start(support.device, say=_say)  # on CUDA unless $SOLUTION_PRECOMPILE=0
    if _installed and support.device == "cuda" and _set_expandable_segments(True):
        _installed[ALLOCATOR] = ("CUDA caching allocator with expandable segments: batches of varying "
                                 "length no longer fragment reserved memory")
        if verbose:
            _say(f"installed {ALLOCATOR}: {_installed[ALLOCATOR]}")
    return dict(_installed)


SKIP_ENV = "SOLUTION_SKIP_PATCHES"
ALLOCATOR = "cuda_allocator"


def check_settings() -> None:
    """Every $SOLUTION_* setting, checked: ValueError (one line naming the variable and what it
    accepts) for the first invalid one. apply() calls it before installing anything; bench.compare
    calls it before its first run."""
    memory_policy()  # $SOLUTION_MEMORY_POLICY
    check_flags()  # the on/off settings (solution.env.FLAGS)
    cuda_graphs.check_settings()  # $SOLUTION_CUDA_GRAPHS / $SOLUTION_GRAPH_BUCKET
    check_skipped_patches()  # $SOLUTION_SKIP_PATCHES


def patch_names() -> list[str]:
    """The names $SOLUTION_SKIP_PATCHES accepts: each patch module's NAME (PATCHES, install order),
    then cuda_allocator."""
    return [importlib.import_module(module_name).NAME for module_name in PATCHES] + [ALLOCATOR]


def skipped_patches() -> set[str]:
    """Patch names listed (comma-separated) in $SOLUTION_SKIP_PATCHES: left out by apply(), to
    compare or to work around a problem."""
    return {name.strip() for name in os.environ.get(SKIP_ENV, "").split(",") if name.strip()}


def check_skipped_patches() -> set[str]:
    """skipped_patches(), or ValueError when one of them names no patch (a typo would otherwise
    leave the patch installed without a word)."""
    skip = skipped_patches()
    known = patch_names()
    unknown = sorted(skip - set(known))
    if unknown:
        raise ValueError(f"${SKIP_ENV}={os.environ.get(SKIP_ENV)!r} names no patch: {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")
    return skip


def _set_expandable_segments(on: bool) -> bool:
    """Turn PyTorch's expandable segments on/off for allocations made from now on. With packed
    batches every step allocates tensors of new sizes; fixed-size segments then fragment (reserved
    memory grows far above what is allocated). Unless the user configured the allocator
    ($PYTORCH_CUDA_ALLOC_CONF) or listed cuda_allocator in $SOLUTION_SKIP_PATCHES."""
    import torch

    if ALLOCATOR in skipped_patches() or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return False
    setting = f"expandable_segments:{on}"
    try:
        if hasattr(torch._C, "_accelerator_setAllocatorSettings"):  # torch >= 2.10
            torch._C._accelerator_setAllocatorSettings(setting)
        else:
            torch.cuda.memory._set_allocator_settings(setting)
    except Exception:  # noqa: BLE001 - an allocator without the setting: leave it as it is
        return False
    return True


def _partial_restore(keep: int) -> None:
    extra = Swaps()
    extra._log = _swaps._log[keep:]
    del _swaps._log[keep:]
    extra.restore()


def revert() -> None:
    """Restore every patched object to the stock one. Safe to call when nothing is installed."""
    _swaps.restore()
    from solution.kernels.lm_head_loss import clear_weight_cache

    clear_weight_cache()  # the LM head's cached fp16 weight (lm_head_loss.cast_frozen_weight)
    if _installed.pop(ALLOCATOR, None) is not None:
        _set_expandable_segments(False)
    _installed.clear()


def installed() -> dict[str, str]:
    return dict(_installed)
