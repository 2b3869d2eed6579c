"""A frozen NF4 linear layer's plan (``LinearPlan``), for the decoder-layer node and the fused MLP:
bitsandbytes' NF4 linear as one dequantization launch into a reused per-device fp16 scratch buffer
(casting x or a gradient to fp16 in the same launch, ``dequant_and_cast``) plus cuBLAS, and the
input gradient with bnb's rounding chain (``input_grad16``); ``input_reason`` says which inputs it
takes. Plain tensors in; what reads a bnb ``Linear4bit`` module is solution/patches/_bnb.py.
What it replaces, why, risks, measurements: docs/kernels/nf4_linear.md.
"""
from __future__ import annotations

import weakref

import torch

from solution.kernels._device import kernel_device_reason, on_current_device
from solution.kernels.nf4_dequant import MAX_CAST_ELEMENTS, DequantPlan, unsupported_reason

# One fp16 buffer per device, reused by every dequantization; stream order makes the reuse safe
# (a dequant into it is queued after the previous GEMM that read it).

_scratch: dict = {}


def scratch_buffer(device: torch.device, numel: int) -> torch.Tensor:
    """A contiguous fp16 buffer of ``numel`` elements on ``device``, shared and reused."""
    key = (device.type, device.index)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float16, device=device)
        _scratch[key] = buf
    return buf[:numel]


def release_scratch() -> None:
    """Drop the scratch buffers (a plan still holding a view of one keeps it alive until that
    plan is dropped or next used: solution/patches/_bnb.py's ``release`` drops the layers' plans too)."""
    _scratch.clear()


_X_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


class LinearPlan:
    """One frozen NF4 weight (packed ``weight``, its ``QuantState`` ``qs``) in a layer computing in
    ``compute_dtype`` (None: not fixed yet), computed once: ``reason`` (None when supported), its
    ``DequantPlan``, sizes, a view of the scratch buffer. Cached per layer while ``matches``."""

    __slots__ = ("weight_ref", "qs", "compute_dtype", "reason", "dq", "n_out", "k",
                 "device", "on_cuda", "round_bwd", "scratch_key", "scratch_base", "w16")

    def __init__(self, weight, qs, compute_dtype):
        # a weak reference: the plan must not keep the weight alive (bnb's Params4bit refers to its
        # module, by which solution/patches/_bnb.py keys its WeakKeyDictionary of plans)
        self.weight_ref, self.qs, self.compute_dtype = weakref.ref(weight), qs, compute_dtype
        self.dq = self.w16 = self.scratch_base = None
        self.reason = self._static_reason(weight, qs, compute_dtype)
        if self.reason is None:
            self.dq = DequantPlan(weight, qs)
            self.n_out, self.k = qs.shape
            self.device = self.dq.device
            self.on_cuda = self.device.type == "cuda"
            self.round_bwd = qs.dtype == torch.bfloat16  # bnb's backward rounds through the state dtype
            self.scratch_key = (self.device.type, self.device.index)

    @staticmethod
    def _static_reason(weight, qs, compute_dtype) -> str | None:
        reason = unsupported_reason(weight, qs)
        if reason is not None:
            return reason
        if compute_dtype != torch.float16:
            return f"compute dtype {compute_dtype} (only fp16 is handled)"
        if len(qs.shape) != 2:
            return "weight shape is not 2-D"
        if qs.nested and qs.state2.blocksize != 256:
            return "nested second-level blocksize != 256 (bnb raises there)"
        return kernel_device_reason(weight.device, current=False)  # the current device: input_reason, each call

    def matches(self, weight, qs, compute_dtype) -> bool:
        return (weight is self.weight_ref() and qs is self.qs and compute_dtype is self.compute_dtype
                and (self.dq is None or self.dq.matches(weight, qs)))

    def weight16(self) -> torch.Tensor:
        """This layer's fp16 weight buffer: a [out, in] view of the shared scratch buffer."""
        if self.w16 is None or _scratch.get(self.scratch_key) is not self.scratch_base:  # first use / buffer replaced
            flat = scratch_buffer(self.device, self.dq.numel)
            self.scratch_base = _scratch[self.scratch_key]
            self.w16 = flat.view(self.dq.shape)
        return self.w16

    def dequant_and_cast(self, t: torch.Tensor, round_bf16: bool = False):
        """(w16, t16): the weight dequantized into the scratch buffer and ``t`` cast to fp16, in the
        same launch when ``t`` is fp32 and contiguous (else by torch)."""
        w16 = self.weight16()
        if t.dtype == torch.float32 and t.is_contiguous() and t.numel() < MAX_CAST_ELEMENTS:
            t16 = torch.empty(t.shape, dtype=torch.float16, device=t.device)
            self.dq.launch(w16, round_bf16, a=t, a16=t16)
        else:
            t16 = t if t.dtype == torch.float16 else t.to(torch.float16)
            self.dq.launch(w16, round_bf16)
        return w16, t16

    def input_grad16(self, g16: torch.Tensor) -> torch.Tensor:
        """fp16 g16 [..., out] @ W -> [..., in], W dequantized with bnb's backward rounding chain
        (``round_bwd``), as MatMul4Bit's backward; the GEMM follows the dequantization at once."""
        w16 = self.weight16()
        self.dq.launch(w16, self.round_bwd)
        return torch.matmul(g16, w16)


def input_reason(plan: LinearPlan, x: torch.Tensor) -> str | None:
    """None when our path takes input ``x`` for ``plan``'s weight; else why not."""
    if plan.reason is not None:
        return plan.reason
    if x.dtype not in _X_DTYPES:
        return f"input dtype {x.dtype}"
    if x.device != plan.device:
        return "input and weight on different devices"
    if not on_current_device(x.device):
        return f"{x.device} is not the current CUDA device"
    if x.dim() == 0 or x.shape[-1] != plan.k or x.numel() == 0:
        return "input / weight shapes"
    return None
