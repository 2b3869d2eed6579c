"""Variable-length attention's switch for the packed step (the step's layer 2).

The decoder-layer node (step/layer.py) runs attention on the packed rows with PyTorch's
memory-efficient kernel in its variable-length mode (``cu_seqlens``, causal within each row;
solution/kernels/attn_varlen.py). With right padding a real query at position t attends to keys
0..t of its row, all real: the set of keys is stock's, so the values are the same up to the
attention kernel's rounding. ``varlen_works`` asks, once per device, dtype and head dim, whether
that kernel runs here; where it refuses, the packed step is off and stock's forward runs.
"""
from __future__ import annotations

import torch

from solution import state
from solution.say import say
from solution.kernels import attn_varlen


def varlen_enabled() -> bool:
    """Variable-length attention on the packed rows (solution/kernels/attn_varlen.py): true until
    the kernel refused this machine (``_varlen_failed``). Attention reads each packed row's extent
    from ``cu_seqlens``, so an extra packed row (a filler: packing.make_unpadded's ``extra``)
    attends only to itself."""
    return _VARLEN_FAILED is None


_VARLEN_FAILED: str | None = None


_PREFLIGHT: dict = state.kept({})  # (device, dtype, head_dim) -> the kernel ran forward and backward there


@state.on_clear
def _forget_refusal() -> None:
    """revert(): a later apply() asks the variable-length kernel again."""
    global _VARLEN_FAILED
    _VARLEN_FAILED = None


def varlen_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Variable-length attention runs here: ``varlen_enabled`` and, on CUDA, the private ATen ops'
    schemas as reviewed (``attn_varlen.schema_refusal``) and a tiny forward and backward of the
    kernel once per device, dtype and head dim (``attn_varlen.preflight``). Where
    PyTorch's kernel refuses (never seen on the H200; a T4 was never measured), this says so once
    and turns the packed step off for good (``_varlen_failed``: stock's forward runs) before any
    step depends on it: the decoder-layer node calls the kernel with no fallback of its own, and a
    refusal in a backward could not be caught. Not run inside a CUDA graph capture (a failed capture falls back and the
    next eager step asks), nor without CUDA (the CPU runs the row-by-row reference)."""
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
    """The variable-length kernel refused this machine's inputs (it was measured on an H200 taking
    the T4's paths, never on a real T4): say so once; stock's forward runs from now on."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED is None:
        first_line = (str(exc).splitlines() or [""])[0][:200]
        _VARLEN_FAILED = f"{type(exc).__name__}: {first_line}"
        say(f"variable-length attention failed ({_VARLEN_FAILED}); the packed step is off from now on "
            "(stock's forward)")
