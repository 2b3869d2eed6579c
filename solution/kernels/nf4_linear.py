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
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from solution.env import interpreter_enabled
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
    """Drop the scratch buffers and the per-layer plans (which view them), e.g. after revert()."""
    _scratch.clear()
    _PLANS.clear()


# ---------------------------------------------------------------------------------------------
# per-layer plan

_X_DTYPES = (torch.float16, torch.float32, torch.bfloat16)
_fix_quant_state = None  # bitsandbytes' fix_4bit_weight_quant_state_from_module, loaded lazily
_cuda_ops = None         # bitsandbytes.backends.cuda.ops (its fused-GEMM heuristic), loaded lazily


class LinearPlan:
    """What our path needs to know about one bnb ``Linear4bit``, computed once: ``reason`` (None
    when the layer itself is supported: NF4 state, fp16 compute dtype, a device our kernels run
    on), its ``DequantPlan``, sizes, and a view of the shared scratch buffer. Cached per layer
    (``linear_plan``); rebuilt when the weight, its quant state or the compute dtype change."""

    __slots__ = ("weight_ref", "qs", "compute_dtype", "type_set", "reason", "dq", "n_out", "k",
                 "device", "on_cuda", "round_bwd", "scratch_key", "scratch_base", "w16")

    def __init__(self, module, weight, qs):
        # a weak reference: Params4bit keeps a reference to its module (``weight.module``), and a
        # strong one here would keep the layer alive through the WeakKeyDictionary forever
        self.weight_ref, self.qs = weakref.ref(weight), qs
        self.compute_dtype, self.type_set = module.compute_dtype, module.compute_type_is_set
        self.dq = self.w16 = self.scratch_base = None
        self.reason = self._static_reason(module, weight, qs)
        if self.reason is None:
            self.dq = DequantPlan(weight, qs)
            self.n_out, self.k = qs.shape
            self.device = self.dq.device
            self.on_cuda = self.device.type == "cuda"
            self.round_bwd = qs.dtype == torch.bfloat16  # bnb's backward rounds through the state dtype
            self.scratch_key = (self.device.type, self.device.index)

    @staticmethod
    def _static_reason(module, weight, qs) -> str | None:
        reason = unsupported_reason(weight, qs)
        if reason is not None:
            return reason
        if module.compute_dtype != torch.float16 or not module.compute_type_is_set:
            return f"compute dtype {module.compute_dtype} (only fp16 is handled)"
        if len(qs.shape) != 2:
            return "weight shape is not 2-D"
        if qs.nested and qs.state2.blocksize != 256:
            return "nested second-level blocksize != 256 (bnb raises there)"
        dev = weight.device.type
        if dev == "cuda":
            if interpreter_enabled():
                return "TRITON_INTERPRET=1 with CUDA tensors"
        elif dev == "cpu":
            if not interpreter_enabled():
                return "CPU tensor without the Triton interpreter"
        else:
            return f"device {dev}"
        return None

    def matches(self, module, weight, qs) -> bool:
        return (weight is self.weight_ref() and qs is self.qs and module.compute_dtype is self.compute_dtype
                and module.compute_type_is_set == self.type_set
                and (self.dq is None or self.dq.matches(weight, qs)))

    def weight16(self) -> torch.Tensor:
        """This layer's fp16 weight buffer: a [out, in] view of the shared scratch buffer."""
        if self.w16 is None or _scratch.get(self.scratch_key) is not self.scratch_base:  # first use / buffer replaced
            flat = scratch_buffer(self.device, self.dq.numel)
            self.scratch_base = _scratch[self.scratch_key]
            self.w16 = flat.view(self.dq.shape)
        return self.w16

    def dequant_and_cast(self, t: torch.Tensor, round_bf16: bool = False):
        """(w16, t16): dequantize the weight into the scratch buffer and cast ``t`` (activations
        or a gradient) to fp16 in the same launch when it is fp32 and contiguous; otherwise torch
        casts it (bf16, strided: torch's own layout rules) and the launch only dequantizes."""
        w16 = self.weight16()
        if t.dtype == torch.float32 and t.is_contiguous() and t.numel() < MAX_CAST_ELEMENTS:
            t16 = torch.empty(t.shape, dtype=torch.float16, device=t.device)
            self.dq.launch(w16, round_bf16, a=t, a16=t16)
        else:
            t16 = t if t.dtype == torch.float16 else t.to(torch.float16)
            self.dq.launch(w16, round_bf16)
        return w16, t16


_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Linear4bit -> LinearPlan


def _param(module, name: str):
    """``module.<name>`` for a parameter, without nn.Module.__getattr__'s Python overhead."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def linear_plan(module) -> LinearPlan:
    """The cached plan of a bnb ``Linear4bit`` (bnb's quant-state repair included, as its forward
    does first)."""
    global _fix_quant_state
    weight = _param(module, "weight")
    qs = getattr(weight, "quant_state", None)
    if qs is None:  # bnb's forward starts with this repair (e.g. after FSDP-style conversions)
        if _fix_quant_state is None:
            from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module as _fix_quant_state
        _fix_quant_state(module)
        weight = _param(module, "weight")
        qs = getattr(weight, "quant_state", None)
    plan = _PLANS.get(module)
    if plan is None or not plan.matches(module, weight, qs):
        plan = LinearPlan(module, weight, qs)
        _PLANS[module] = plan
    return plan


def bnb_would_use_fused_gemm(x: torch.Tensor, plan: LinearPlan) -> bool:
    return bnb_would_use_fused_gemm_m(x.numel() // plan.k, x.device.index, plan)


def bnb_would_use_fused_gemm_m(m: int, device_index, plan: LinearPlan) -> bool:
    """True when bnb 0.50's gemm_4bit would run its own fused 4-bit GEMM for this call (small M on
    CUDA), whose rounding differs from dequant + cuBLAS: we leave those calls to bnb. Mirrors
    ``bitsandbytes.backends.cuda.ops``' dispatch: M > ``_gemm_4bit_custom_max_m`` (1536) or K not a
    multiple of the blocksize -> dequant + F.linear; else ``_gemm_4bit_use_custom_fn`` decides."""
    global _cuda_ops
    if not plan.on_cuda:
        return False  # CPU: bnb's default gemm_4bit is dequant + F.linear, like ours
    k = plan.k
    if _cuda_ops is None:
        try:
            from bitsandbytes.backends.cuda import ops as _cuda_ops
        except Exception:
            _cuda_ops = False
    if _cuda_ops is False:
        return m <= 4
    if m > getattr(_cuda_ops, "_gemm_4bit_custom_max_m", 1536):
        return False
    if k % plan.qs.blocksize != 0:
        return False
    choose = getattr(_cuda_ops, "_gemm_4bit_use_custom_fn", None)
    if choose is None:
        return m <= 4
    return bool(choose(device_index, torch.float16, m, plan.n_out, k))


def call_reason(plan: LinearPlan, module, x: torch.Tensor) -> str | None:
    """None when this call (layer ``plan``, input ``x``) can take our path; else why not."""
    if plan.reason is not None:
        return plan.reason
    if x.dtype not in _X_DTYPES:
        return f"input dtype {x.dtype}"
    if x.device != plan.device:
        return "input and weight on different devices"
    if x.dim() == 0 or x.shape[-1] != plan.k or x.numel() == 0:
        return "input / weight shapes"
    if plan.on_cuda:
        if bnb_would_use_fused_gemm(x, plan):
            return "bnb's fused small-M 4-bit GEMM keeps this call"
    elif getattr(module, "support_avx512bf16_for_cpu", False) and not module.training and not x.requires_grad:
        return "bnb's CPU inference repacking path"
    return None


def linear4bit_unsupported(module, x: torch.Tensor) -> str | None:
    """None when ``module`` (a bnb.nn.Linear4bit) called on ``x`` can take our path; else why not."""
    return call_reason(linear_plan(module), module, x)


def linear4bit_bias(module):
    """bnb's Linear4bit.forward bias handling, side effect included: the bias parameter is cast
    to fp16 IN PLACE when it differs (``bias.data = bias.data.to(x.dtype)``), then
    ``bias.to(compute_dtype)``, which returns the parameter itself once it is fp16."""
    bias = _param(module, "bias")
    if bias is not None and bias.dtype != torch.float16:
        bias.data = bias.data.to(torch.float16)
    return bias


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
    """bnb Linear4bit's forward on our path (after ``call_reason`` said yes): x [..., in] fp32 /
    fp16 / bf16 -> [..., out] in x's dtype; autograd for x and the bias only."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias16 is not None and bias16.requires_grad)):
        return NF4LinearFunction.apply(x, bias16, plan)
    w16, x16 = plan.dequant_and_cast(x)
    out = F.linear(x16, w16, bias16)
    return out if x.dtype == torch.float16 else out.to(x.dtype)
