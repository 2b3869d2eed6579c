"""Variable-length attention's switch for the packed step (the step's layer 2): ``varlen_works`` asks whether
PyTorch's variable-length kernel (kernels/attn_varlen.py), which the decoder-layer node calls with no fallback,
runs here; where it refuses, the packed step is off and stock's forward runs.
"""
from __future__ import annotations

import torch

from solution import state
from solution.say import say
from solution.kernels import attn_varlen


def varlen_enabled() -> bool:
    """Variable-length attention on the packed rows: true until the kernel refused this machine."""
    return _VARLEN_FAILED is None


_VARLEN_FAILED: str | None = None


_PREFLIGHT: dict = state.kept({})  # (device, dtype, head_dim) -> the kernel ran forward and backward there


@state.on_clear
def _forget_refusal() -> None:
    """revert(): a later apply() asks the variable-length kernel again."""
    global _VARLEN_FAILED
    _VARLEN_FAILED = None


def varlen_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """``varlen_enabled`` and, on CUDA, the private ops' schemas as reviewed and a tiny forward and backward
    once per device, dtype and head dim. A refusal is said once and turns the packed step off for good before
    any step depends on it (a refusal in a backward could not be caught). Not asked inside a capture (the next
    eager step asks) nor without CUDA (the CPU runs the row-by-row reference)."""
    if not varlen_enabled():
        return False
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return True
    key = (device, dtype, head_dim)
    ok = _PREFLIGHT.get(key)
    if ok is None:
        # the private ATen ops' schemas first (the kernel is called positionally), then a run
        refusal = attn_varlen.schema_refusal() or attn_varlen.preflight(device, dtype, head_dim)
        ok = _PREFLIGHT[key] = refusal is None
        if refusal is not None:
            _varlen_failed(refusal)
    return ok


def _varlen_failed(exc: Exception) -> None:
    """The variable-length kernel refused this machine: say so once; stock's forward runs from now on."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED is None:
        first_line = (str(exc).splitlines() or [""])[0][:200]
        _VARLEN_FAILED = f"{type(exc).__name__}: {first_line}"
        say(f"variable-length attention failed ({_VARLEN_FAILED}); the packed step is off from now on "
            "(stock's forward)")
