"""Can our Triton kernels run on this tensor's device? One rule for every caller: yes on a CUDA
device of compute capability 7.5 or newer (sm_75, the T4: every kernel is checked for it,
solution/sm75_check.py) while Triton's interpreter is off, and on the CPU while TRITON_INTERPRET=1;
no anywhere else, nor on a CUDA device other than the current one (a Triton launch runs on the
current device and stream: with several GPUs visible, e.g. accelerate's ``device_map="auto"`` on
Kaggle's "GPU T4 x2", the layers on the other GPU run the stock path).
``kernel_device_reason(device)`` says why not (None: they run), ``runs_here(device)`` as a bool.
The answer is kept per (device, interpreter on / off); the current-device part is asked at every
call (one global read with one GPU). Dtype checks stay with the callers. Pure: torch and settings.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from solution.settings import interpreter_enabled

if TYPE_CHECKING:
    import torch

MIN_CAPABILITY = (7, 5)

# interpreter off / on -> {torch.device: reason, None when the kernels run there}
_REASONS: tuple[dict, dict] = ({}, {})
# more than one CUDA device visible (None: not asked yet; asked once, at the first CUDA tensor)
_SEVERAL_GPUS: bool | None = None


def kernel_device_reason(device: torch.device, current: bool = True) -> str | None:
    """None when our kernels run on ``device``; else a one-line reason. ``current=False`` leaves out
    the current-device part (for a reason kept across calls; ask ``on_current_device`` each call)."""
    interpreter = interpreter_enabled()
    cache = _REASONS[interpreter]
    try:
        reason = cache[device]
    except KeyError:
        reason = cache[device] = _reason(device, interpreter)
    if reason is None and current and not on_current_device(device):
        import torch

        return f"{device} is not the current CUDA device (cuda:{torch.cuda.current_device()}); kernels launch on that one"
    return reason


def runs_here(device: torch.device) -> bool:
    """``kernel_device_reason(device) is None``."""
    return kernel_device_reason(device) is None


def on_current_device(device: torch.device) -> bool:
    """False only for a CUDA device other than the current one while several GPUs are visible."""
    global _SEVERAL_GPUS
    if device.type != "cuda":
        return True
    several = _SEVERAL_GPUS
    if several is None:
        import torch

        several = _SEVERAL_GPUS = torch.cuda.device_count() > 1
    if not several or device.index is None:
        return True
    import torch

    return device.index == torch.cuda.current_device()


def cuda_or_runs_here(device: torch.device) -> bool:
    """The rule of the norm, RoPE and decoder-layer sites: the current CUDA device (also under
    TRITON_INTERPRET=1) or ``runs_here``; never a CUDA device other than the current one."""
    return (device.type == "cuda" and on_current_device(device)) or runs_here(device)


def capability_reason(device: torch.device | None = None) -> str | None:
    """Why the CUDA ``device`` (None: the current one) is older than sm_75; None if not. Not cached."""
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
