"""Environment checks that decide whether our kernels may run. apply() never crashes on an unsupported
environment: it keeps the stock path and says why."""
from __future__ import annotations

from dataclasses import dataclass

from solution.kernels._device import capability_reason
from solution.settings import interpreter_enabled


@dataclass(frozen=True)
class Support:
    ok: bool
    device: str  # "cuda", "interpreter" (CPU through TRITON_INTERPRET=1) or "none"
    reason: str


def check_support() -> Support:
    """Can our kernels run here, and on what: a CUDA GPU of sm_75 or newer with Triton >= 3.2 and its
    launcher build; without CUDA, TRITON_INTERPRET=1 (the CPU interpreter, for correctness); else no, why."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return Support(False, "none", "PyTorch is not installed")
    try:
        import triton
    except ImportError:
        return Support(False, "none", "Triton is not installed (pip install triton)")
    too_old = triton_too_old(getattr(triton, "__version__", "0"))
    if too_old:
        return Support(False, "none", too_old)
    missing = torch_internals_reason()
    if missing:
        return Support(False, "none", missing)
    if torch.cuda.is_available():
        too_old = capability_reason()  # the current GPU: solution/kernels/_device.py's rule
        if too_old:
            return Support(False, "none", too_old)
        if interpreter_enabled():
            return Support(True, "interpreter", "TRITON_INTERPRET=1: kernels run on the CPU interpreter")
        cannot_build = triton_build_reason()
        if cannot_build:
            return Support(False, "none", cannot_build)
        major, minor = torch.cuda.get_device_capability()
        return Support(True, "cuda", f"CUDA GPU {torch.cuda.get_device_name()} (sm_{major}{minor})")
    if interpreter_enabled():
        return Support(True, "interpreter", "no CUDA; TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter")
    return Support(False, "none", "no CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)")


def torch_internals_reason() -> str | None:
    """None when the private torch names the package reads are there (``torch._C.DisableTorchFunctionSubclass``;
    nn.Module's ``_modules``, ``_parameters``, ``_buffers`` and hook dicts, solution/hooks.py), else the reason
    (apply() installs nothing): without them those reads would be wrong, not fail (docs/GATES.md)."""
    import torch
    from torch.nn.modules import module as nn_module

    from solution.hooks import GLOBAL_HOOKS, OWN_HOOKS

    if not hasattr(torch._C, "DisableTorchFunctionSubclass"):
        return "this torch has no torch._C.DisableTorchFunctionSubclass"
    own = torch.nn.Module().__dict__
    missing = [name for name in ("_modules", "_parameters", "_buffers") + OWN_HOOKS
               if not isinstance(own.get(name), dict)]
    missing += [name for name in GLOBAL_HOOKS if not isinstance(getattr(nn_module, name, None), dict)]
    if missing:
        return f"torch.nn.Module's internals are not the ones our patches read (missing {', '.join(missing)})"
    return None


def triton_build_reason() -> str | None:
    """Why Triton could not build its launchers here (None: it can). At the first launch Triton compiles C
    modules with $CC (else gcc or clang) against Python's headers, linking libcuda.so.1: without one of them
    that launch would fail inside the training step. Checks presence only; ``triton.knobs.build.impl`` is trusted."""
    import os
    import shutil
    import sysconfig

    from solution.settings import c_compiler

    try:
        from triton import knobs

        if knobs.build.impl is not None:
            return None
    except Exception:  # noqa: BLE001 - Triton before 3.4 has no knobs: the compiler is looked for as below
        pass
    cc = c_compiler()
    if cc is not None and shutil.which(cc) is None:
        return f"$CC={cc!r} is not an executable: Triton compiles its kernels' launchers with it"
    if cc is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        return "no C compiler (gcc or clang, or $CC): Triton compiles its kernels' launchers with one"
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return (f"Python's C headers are missing ({include}/Python.h; e.g. the python3-dev package): Triton "
                "compiles its kernels' launchers against them")
    try:
        from triton.backends.nvidia.driver import libcuda_dirs
    except Exception:  # noqa: BLE001 - another Triton layout: its first launch will tell
        return None
    try:
        libcuda_dirs()
    except Exception as exc:  # noqa: BLE001 - AssertionError, ldconfig missing, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"Triton cannot find the CUDA driver library libcuda.so.1 ({first})"
    return None


def several_gpus_note() -> str | None:
    """A line for apply() when several CUDA GPUs are visible (else None): Soup's ``device_map="auto"`` then
    spreads the model, and such a run is correct but mostly stock (step/decoder.py)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return None
    return (f"{n} CUDA GPUs visible: a model spread over them (device_map='auto') runs our kernels only on the "
            f"current GPU's layers and the packed step not at all (stock path there); the challenge's workload "
            f"is one GPU: CUDA_VISIBLE_DEVICES=0")


# The oldest Triton our kernels are tested with (torch 2.6's; 3.0 / 3.1's interpreter cannot run them).
OLDEST_TRITON = (3, 2)


def triton_too_old(version: str) -> str | None:
    """Why this Triton version is refused (None: accepted)."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"Triton version {version!r} not understood"
    if (major, minor) < OLDEST_TRITON:
        return (f"Triton {version} is older than {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]}, the oldest our kernels "
                f"are tested with (PyTorch >= 2.6 brings it)")
    return None
