"""apply() / revert(): install our kernels into the stock libraries, or take them out again."""
from __future__ import annotations

import importlib

from solution import precompile, settings as _settings, state
from solution.say import say
from solution.env import check_support, several_gpus_note
from solution.patches import PATCHES
from solution.patches._base import Swaps
from solution.settings import SKIP_ENV, Settings, check_skip_patches


_swaps = Swaps()
_installed: dict[str, str] = {}



def apply(verbose: bool = True, settings: Settings | None = None) -> dict[str, str]:
    """Install every patch this environment supports; returns {patch name: description}. Idempotent: once
    something is installed, a second call returns it and changes nothing until revert().

    ``settings`` (None: Settings.from_env(), read here) are validated before anything is installed
    (ValueError) and active until revert(): a $SOLUTION_* variable set after apply() changes nothing. Where
    the environment or a patch's check() refuses, that part is not installed, one line says why, and
    training runs the stock path.
    """
    if _installed:
        return dict(_installed)
    # a bad $SOLUTION_* value is the user's error: raise before touching anything
    if settings is None:
        settings = check_settings()
    else:
        check_skip_patches(settings.skip_patches, patch_names())
    support = check_support()
    if not support.ok:
        say(f"falling back to the stock path: {support.reason}")
        return {}
    _settings.activate(settings)  # what the patches read while they install and run
    if verbose:
        say(f"kernels run on: {support.reason}")
    if support.device == "cuda" and (note := several_gpus_note()):
        say(note)
    skip = settings.skip_patches
    for module_name in PATCHES:
        module = importlib.import_module(module_name)
        reason = f"listed in {SKIP_ENV}" if module.NAME in skip else module.check()
        if reason is not None:
            also = getattr(module, "ALSO_OFF_WHEN_SKIPPED", None)  # what else needs this patch
            say(f"skip {module.NAME}: {reason} (stock path kept)" + (f"; this also turns off {also}" if also else ""))
            continue
        before = len(_swaps)
        try:
            desc = module.install(_swaps)
        except Exception as exc:  # never leave a half-installed patch behind
            _partial_restore(before)
            say(f"skip {module.NAME}: install failed ({type(exc).__name__}: {exc}); stock path kept")
            continue
        _installed[module.NAME] = desc
        if verbose:
            say(f"installed {module.NAME}: {desc}")
    if _installed:
        precompile.start(support.device, say=say)  # on CUDA unless $SOLUTION_PRECOMPILE=0
    if _installed and support.device == "cuda" and ALLOCATOR not in skip and not _settings.allocator_configured():
        if _set_expandable_segments(True):
            _installed[ALLOCATOR] = ("CUDA caching allocator with expandable segments: batches of varying "
                                     "length no longer fragment reserved memory")
            if verbose:
                say(f"installed {ALLOCATOR}: {_installed[ALLOCATOR]}")
        else:
            say(f"skip {ALLOCATOR}: this torch's allocator did not take expandable_segments (stock allocator kept)")
    return dict(_installed)


ALLOCATOR = "cuda_allocator"


def check_settings() -> Settings:
    """Every $SOLUTION_* setting read now and checked: ValueError naming the first invalid variable."""
    return Settings.from_env(known_patches=patch_names())


def patch_names() -> list[str]:
    """The names $SOLUTION_SKIP_PATCHES accepts: each patch's NAME in install order, then cuda_allocator."""
    return [importlib.import_module(module_name).NAME for module_name in PATCHES] + [ALLOCATOR]


def _set_expandable_segments(on: bool) -> bool:
    """Turn PyTorch's expandable segments on/off for later allocations (packed batches allocate new sizes
    every step, which fragments fixed-size segments). Private torch calls (docs/GATES.md); False where
    neither takes the setting (the allocator stays as it is)."""
    import torch

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
    """Restore every patched object and forget every plan, cache and decision (solution/state.py), so that a
    later apply() starts afresh. Safe when nothing is installed."""
    _swaps.restore()
    from solution.kernels.lm_head_loss import clear_weight_cache
    from solution.kernels.nf4_linear import release_scratch

    clear_weight_cache()  # the LM head's cached fp16 weight (lm_head_loss.cast_frozen_weight)
    release_scratch()  # the NF4 dequantization's scratch buffers
    state.clear()  # every plan, cache and decision (solution/state.py)
    if _installed.pop(ALLOCATOR, None) is not None:
        _set_expandable_segments(False)
    _installed.clear()
    _settings.activate(None)


def installed() -> dict[str, str]:
    return dict(_installed)
