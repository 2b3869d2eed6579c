"""Frozen NF4 linear layer: y = x @ dequant(W)^T + b with our one-kernel NF4 dequantization and
cuBLAS, as a torch.autograd.Function that gives only grad_input (and grad_bias when the bias is
trainable), never a weight gradient.

What it replaces (bitsandbytes 0.50.2, read in the installed package):
``bnb.nn.Linear4bit.forward`` casts x to the compute dtype (fp16), casts the bias *parameter* to
x.dtype in place (``bias.data = bias.data.to(x.dtype)``: q/k/v biases that
prepare_model_for_kbit_training made fp32 become fp16 after the first call), calls
``bnb.matmul_4bit`` -> ``MatMul4Bit`` -> ``torch.ops.bitsandbytes.gemm_4bit``, and casts the
result back to x's dtype. On CUDA ``gemm_4bit`` either runs bnb's fused 4-bit GEMM (small M only:
``_gemm_4bit_use_custom_fn``) or ``_dequant_linear_fallback``: two dequantization launches (scales,
then weights) and a torch add into freshly allocated tensors, then ``F.linear(x, W, bias)``.
Backward (``MatMul4Bit.backward``, after autograd cast the fp32 gradient to fp16):
``grad @ dequantize_4bit(W).to(grad.dtype)`` where ``dequantize_4bit`` produces
``quant_state.dtype`` (a second rounding when the state was quantized from bf16), then autograd
casts the fp16 input gradient back to fp32; ``grad.sum(0, dtype=bias.dtype)`` for a trainable bias.
Per call on the GPU (fp32 activations): 6 kernels forward (cast x, 3 for the weight, GEMM, cast
out), 6 backward (cast grad, 3 for the weight, GEMM, cast grad_x), 3 autograd nodes.

What we do: the same in-place bias cast; ONE Triton launch that dequantizes the weight into a
reused per-device scratch buffer AND casts x to fp16 (``nf4_dequant_cast_kernel``: same bits as
``x.to(torch.float16)``); the very same ``F.linear(x16, W, bias16)`` call -> the same cuBLAS GEMM
on the same fp16 operands, so the forward is bit-identical to bnb's dequant+linear path; the cast
back to x's dtype. Backward: ONE launch re-dequantizes (with bnb's rounding chain) and casts the
fp32 gradient to fp16, then the same ``torch.matmul`` and the cast back. That is 3 kernels forward
and 3 backward, in one autograd node. When bnb would choose its fused small-M kernel we leave the
call to bnb, so the numerics stay bnb's there as well.

Per-call Python work is kept small: everything about a layer that does not depend on x (checks
of the weight and its state, kernel arguments, the scratch view) is computed once per layer into
a ``LinearPlan`` (cached, re-validated by identity checks only), and the packed weight is
handed to Triton as a plain tensor (``Params4bit`` runs Python code on every tensor method).
The host cost of each: docs/kernels/nf4_linear.md, section 3.

This file takes tensors and plain arguments (the packed weight, its quant state, the layer's
compute dtype, x); what reads a bnb ``Linear4bit`` module (the per-layer plan cache, bnb's
quant-state repair, its fused-GEMM choice, the in-place bias cast) is solution/patches/_bnb.py.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from solution.kernels._device import kernel_device_reason, on_current_device
from solution.kernels.nf4_dequant import MAX_CAST_ELEMENTS, DequantPlan, unsupported_reason

# ---------------------------------------------------------------------------------------------
# scratch buffer: one fp16 buffer per device, reused by every dequantization (forward, recompute
# and backward of all 196 NF4 linears). Stream order makes the reuse safe: a dequant into the
# buffer is queued after the previous GEMM that read it.

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


# ---------------------------------------------------------------------------------------------
# per-weight plan

_X_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


class LinearPlan:
    """What our path needs to know about one frozen NF4 weight (the packed ``weight`` tensor and
    its quant state ``qs``, bitsandbytes' ``QuantState`` fields) in a layer that computes in
    ``compute_dtype`` (None: not fixed yet), computed once: ``reason`` (None when supported: NF4
    state, fp16 compute, 2-D, a device our kernels run on), its ``DequantPlan``, sizes, and a view
    of the shared scratch buffer. Its caller caches it per layer and rebuilds it when ``matches``
    fails (the weight, its quant state or the compute dtype changed): solution/patches/_bnb.py."""

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
        """(w16, t16): dequantize the weight into the scratch buffer and cast ``t`` (activations or a
        gradient) to fp16 in the same launch when it is fp32 and contiguous; otherwise torch casts it
        (bf16, strided: torch's own layout rules) and the launch only dequantizes."""
        w16 = self.weight16()
        if t.dtype == torch.float32 and t.is_contiguous() and t.numel() < MAX_CAST_ELEMENTS:
            t16 = torch.empty(t.shape, dtype=torch.float16, device=t.device)
            self.dq.launch(w16, round_bf16, a=t, a16=t16)
        else:
            t16 = t if t.dtype == torch.float16 else t.to(torch.float16)
            self.dq.launch(w16, round_bf16)
        return w16, t16

    def input_grad16(self, g16: torch.Tensor) -> torch.Tensor:
        """g16 @ W for an fp16 output gradient g16 [..., out]: the weight dequantized with bnb's
        backward rounding chain (``round_bwd``) into the scratch buffer, then ``torch.matmul``, as
        bnb's MatMul4Bit backward computes the input gradient (fp16 [..., in]). The GEMM is queued
        right after the dequantization, so no other weight can take the buffer in between."""
        w16 = self.weight16()
        self.dq.launch(w16, self.round_bwd)
        return torch.matmul(g16, w16)


def input_reason(plan: LinearPlan, x: torch.Tensor) -> str | None:
    """None when our path takes input ``x`` for the weight of ``plan``; else why not (the plan's
    own reason first)."""
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


# ---------------------------------------------------------------------------------------------
# the layer

class NF4LinearFunction(torch.autograd.Function):
    """out = fp16 GEMM F.linear(fp16(x), dequant(W), bias16), returned in x's dtype; backward:
    grad_x = (fp16(grad) @ dequant(W)) in x's dtype, grad_bias if the bias requires grad. The
    casts of x, of the output and of the gradients are inside (one autograd node instead of
    three), with the values of bnb's / autograd's casts."""

    @staticmethod
    def forward(ctx, x, bias16, plan):
        w16, x16 = plan.dequant_and_cast(x)
        out = F.linear(x16, w16, bias16)
        # like bnb's MatMul4Bit: keep only the plan (packed weight + state, persistent), never
        # the fp16 weight, so nothing of size out x in stays alive until backward
        ctx.plan = plan
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias16 is None else bias16.dtype
        return out if x.dtype == torch.float16 else out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        plan = ctx.plan
        grad_x = grad_bias = None
        if need_x:
            # one launch: W in bnb's backward rounding chain + fp16(grad) (autograd's cast of the
            # gradient of our fp32 output)
            w16, g16 = plan.dequant_and_cast(grad_out, plan.round_bwd)
            grad_x = torch.matmul(g16, w16)
            if ctx.x_dtype != torch.float16:
                grad_x = grad_x.to(ctx.x_dtype)
        else:
            g16 = grad_out if grad_out.dtype == torch.float16 else grad_out.to(torch.float16)
        if need_bias:
            grad_bias = g16.reshape(-1, g16.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, grad_bias, None


def nf4_linear_call(plan: LinearPlan, x: torch.Tensor, bias16: torch.Tensor | None) -> torch.Tensor:
    """bnb Linear4bit's forward on our path (after ``input_reason`` and the caller's own checks said
    yes: solution/patches/_bnb.py's ``call_reason``): x [..., in] fp32 /
    fp16 / bf16 -> [..., out] in x's dtype; autograd for x and the bias only."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias16 is not None and bias16.requires_grad)):
        return NF4LinearFunction.apply(x, bias16, plan)
    w16, x16 = plan.dequant_and_cast(x)
    out = F.linear(x16, w16, bias16)
    return out if x.dtype == torch.float16 else out.to(x.dtype)
