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
then weights) into a freshly allocated fp16 weight, then ``F.linear(x, W, bias)``. Backward
(``MatMul4Bit.backward``): ``grad @ dequantize_4bit(W).to(grad.dtype)`` where ``dequantize_4bit``
produces ``quant_state.dtype`` (a second rounding when the state was quantized from bf16), and
``grad.sum(0, dtype=bias.dtype)`` for a trainable bias.

What we do: the same casts and the same in-place bias cast, our single dequant kernel into one
reused per-device scratch buffer (sized for the largest weight seen, 27.5 MB for the MLP), then
the very same ``F.linear(x, W, bias)`` call -> the same cuBLAS GEMM on the same fp16 weight, so
the forward is bit-identical to bnb's dequant+linear path; backward re-dequantizes (with bnb's
rounding chain) into the same buffer and runs the same ``torch.matmul``. When bnb would choose its
fused small-M kernel we leave the call to bnb, so the numerics stay bnb's there as well.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from solution.env import interpreter_enabled
from solution.kernels.nf4_dequant import dequantize_nf4, unsupported_reason

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
    """Drop the scratch buffers (e.g. after revert())."""
    _scratch.clear()


def dequantize_to_scratch(weight: torch.Tensor, quant_state, rounding_dtype=torch.float16) -> torch.Tensor:
    n = math.prod(quant_state.shape)
    return dequantize_nf4(weight, quant_state, out=scratch_buffer(weight.device, n),
                          rounding_dtype=rounding_dtype)


class NF4LinearFunction(torch.autograd.Function):
    """out = F.linear(x16, dequant(W), bias16); backward: grad_x = grad @ dequant(W), grad_bias if
    the bias requires grad. W is the packed uint8 Params4bit data (frozen, no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias, quant_state):
        w16 = dequantize_to_scratch(weight, quant_state)
        out = F.linear(x, w16, bias)
        # like bnb's MatMul4Bit: keep the packed weight and its state (persistent, no copy), never
        # the fp16 weight, so nothing of size out x in stays alive until backward
        ctx.weight = weight
        ctx.quant_state = quant_state
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            qs = ctx.quant_state
            # bnb: dequantize_4bit(W, state) is in state.dtype, then .to(grad.dtype)
            w16 = dequantize_to_scratch(ctx.weight, qs, rounding_dtype=qs.dtype)
            grad_x = torch.matmul(grad_out, w16 if grad_out.dtype == torch.float16 else w16.to(grad_out.dtype))
        if ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, None, grad_bias, None


def nf4_linear(x16: torch.Tensor, weight: torch.Tensor, quant_state, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x16, dequant(W), bias) with autograd for x and bias only. x16 fp16 [..., in]."""
    if torch.is_grad_enabled() and (x16.requires_grad or (bias is not None and bias.requires_grad)):
        return NF4LinearFunction.apply(x16, weight, bias, quant_state)
    return F.linear(x16, dequantize_to_scratch(weight, quant_state), bias)


# ---------------------------------------------------------------------------------------------
# when may a bnb.nn.Linear4bit call take this path (shared with the LoRA layer)

def bnb_would_use_fused_gemm(x: torch.Tensor, quant_state) -> bool:
    """True when bnb 0.50's gemm_4bit would run its own fused 4-bit GEMM for this call (small M on
    CUDA), whose rounding differs from dequant + cuBLAS: we leave those calls to bnb."""
    if x.device.type != "cuda":
        return False  # CPU: bnb's default gemm_4bit is dequant + F.linear, like ours
    k = x.shape[-1]
    m = x.numel() // k
    try:
        from bitsandbytes.backends.cuda import ops as cuda_ops
    except Exception:
        return m <= 4
    if m > getattr(cuda_ops, "_gemm_4bit_custom_max_m", 1536):
        return False
    if k % quant_state.blocksize != 0:
        return False
    choose = getattr(cuda_ops, "_gemm_4bit_use_custom_fn", None)
    if choose is None:
        return m <= 4
    return bool(choose(x.device.index, torch.float16, m, quant_state.shape[0], k))


def linear4bit_unsupported(module, x: torch.Tensor) -> str | None:
    """None when ``module`` (a bnb.nn.Linear4bit) called on ``x`` can take our path; else why not.
    Call after ``fix_4bit_weight_quant_state_from_module(module)``."""
    weight = module.weight
    qs = getattr(weight, "quant_state", None)
    reason = unsupported_reason(weight, qs)
    if reason is not None:
        return reason
    if module.compute_dtype != torch.float16 or not module.compute_type_is_set:
        return f"compute dtype {module.compute_dtype} (only fp16 is handled)"
    if len(qs.shape) != 2 or x.dim() == 0 or x.shape[-1] != qs.shape[1] or x.numel() == 0:
        return "input / weight shapes"
    if qs.nested and qs.state2.blocksize != 256:
        return "nested second-level blocksize != 256 (bnb raises there)"
    if x.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        return f"input dtype {x.dtype}"
    if x.device != weight.device:
        return "input and weight on different devices"
    if x.device.type == "cuda":
        if interpreter_enabled():
            return "TRITON_INTERPRET=1 with CUDA tensors"
    elif x.device.type == "cpu":
        if not interpreter_enabled():
            return "CPU tensor without the Triton interpreter"
        if (getattr(module, "support_avx512bf16_for_cpu", False) and not module.training
                and not x.requires_grad):
            return "bnb's CPU inference repacking path"
    else:
        return f"device {x.device.type}"
    if bnb_would_use_fused_gemm(x, qs):
        return "bnb's fused small-M 4-bit GEMM keeps this call"
    return None


def linear4bit_bias(module):
    """bnb's Linear4bit.forward bias handling, side effect included: the bias parameter is cast
    to fp16 IN PLACE when it differs (``bias.data = bias.data.to(x.dtype)``), then used as is."""
    bias = module.bias
    if bias is not None:
        if bias.dtype != torch.float16:
            bias.data = bias.data.to(torch.float16)
        bias = bias.to(module.compute_dtype)
    return bias


def linear4bit_prepare(module, x: torch.Tensor):
    """The prologue of bnb's Linear4bit.forward for the fp16 compute dtype: (x16, bias16)."""
    return x.to(torch.float16), linear4bit_bias(module)
