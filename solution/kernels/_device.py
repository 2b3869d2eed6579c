"""Can our Triton kernels run on this tensor's device? One rule for every caller:

- a CUDA device of compute capability 7.5 or newer (sm_75, the T4: every kernel is compiled and
  checked for it, solution/sm75_check.py) while Triton's interpreter is off;
- the CPU while TRITON_INTERPRET=1 (Triton's interpreter: slow, for tests);
- nothing else: CUDA tensors while the interpreter is on, the CPU without it, other device types,
  GPUs older than sm_75.

``kernel_device_reason(device)`` says why not (None: they run), ``runs_here(device)`` the same as
a bool. The answer is kept per (device, interpreter on or off): the callers run per layer per step,
so after the first call they pay one read of $TRITON_INTERPRET (read at each call, as Triton reads
it) and a dict lookup, never a capability query. What a caller checks on top (dtypes, bf16 needing
sm_80, ...) stays at the caller. Pure: torch and ``interpreter_enabled`` only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from solution.settings import interpreter_enabled

if TYPE_CHECKING:
    import torch

MIN_CAPABILITY = (7, 5)

# interpreter off / on -> {torch.device: reason, None when the kernels run there}
_REASONS: tuple[dict, dict] = ({}, {})


def kernel_device_reason(device: torch.device) -> str | None:
    """None when our kernels run on ``device`` (a tensor's device); else a one-line reason."""
    interpreter = interpreter_enabled()
    cache = _REASONS[interpreter]
    try:
        return cache[device]
    except KeyError:
        reason = cache[device] = _reason(device, interpreter)
        return reason


def runs_here(device: torch.device) -> bool:
    """``kernel_device_reason(device) is None``."""
    return kernel_device_reason(device) is None


def capability_reason(device: torch.device | None = None) -> str | None:
    """Why the CUDA ``device`` (None: the current one) is too old for our kernels; None when it is
    sm_75 or newer. Not cached (kernel_device_reason keeps its answer)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return f"GPU compute capability {major}.{minor} < 7.5 (T4) is not supported"
    return None


def _reason(device: torch.device, interpreter: bool) -> str | None:
    if device.type == "cuda":
        return "CUDA tensors while TRITON_INTERPRET=1" if interpreter else capability_reason(device)
    if device.type == "cpu":
        return None if interpreter else "CPU tensors without the Triton interpreter (TRITON_INTERPRET=1)"
    return f"device {device.type} (kernels need CUDA or TRITON_INTERPRET=1)"
