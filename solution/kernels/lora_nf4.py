"""LoRA on a frozen NF4 linear (peft's ``lora.bnb.Linear4bit``, q_proj / v_proj) as one
torch.autograd.Function, with the elementwise work fused into small Triton kernels.

What peft 0.21.2 computes (``Linear4bit.forward``, single active adapter, not merged, no DoRA,
under torch.autocast(fp16) as in training):
    result = base_layer(x).clone()              # bnb Linear4bit: fp16 GEMM, cast back to x.dtype
    output = lora_B(lora_A(dropout(x))) * scaling   # autocast: fp16 GEMMs, fp16 result
    result = result + output                    # fp32 (x is fp32: the fp32 residual stream)
Element by element that is  out = fp32(base16) + fp32(fp16(fp32(lora16) * scaling)).

What costs: besides the three GEMMs, five full-size elementwise passes in forward (base to fp32,
clone, scale, add, plus the cast of x for lora_A) and, in backward, two casts of the incoming
gradient, the scale, two fp16->fp32 casts of the input gradients and their sum.

What we do instead (same numbers):
  forward : x16 = x.to(fp16) once (shared by the base GEMM and lora_A when there is no dropout),
            base16 = F.linear(x16, W_nf4, bias16), h16 = F.linear(xd16, A16),
            lora16 = F.linear(h16, B16), then ONE kernel writes out = fp32(base16) +
            fp32(fp16(lora16 * scaling)) (``lora_combine_kernel``). No clone, no extra temporaries.
  backward: ONE kernel turns the fp32 gradient into g16 and fp16(g16 * scaling)
            (``lora_grad_split_kernel``); cuBLAS for grad_h, grad_B, grad_A, the lora input
            gradient and the base input gradient (grad16 @ dequant(W), re-dequantized by our
            kernel); without dropout ONE kernel sums the two fp16 input gradients in fp32
            (``lora_grad_sum_kernel``), as autograd's accumulation of the two fp32 casts does.
Dropout stays torch's own call on x (same RNG stream, same mask, same recompute under gradient
checkpointing); its output is passed in as ``xd`` and its backward stays torch's.
Gradients of A and B come back in the parameters' own dtype (bf16 / fp32 / fp16), as the
autocast cast's backward gives them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

from solution.kernels._launches import record
from solution.kernels.nf4_linear import dequantize_to_scratch

GPU_BLOCK = 2048
GPU_NUM_WARPS = 8
INTERPRETER_BLOCK = 1 << 16


@triton.jit
def lora_combine_kernel(base_ptr, lora_ptr, out_ptr, n, scaling, BLOCK: tl.constexpr):
    """out = fp32(base) + fp32(fp16(fp32(lora) * scaling)), stored in out's dtype (fp32 or fp16).
    base, lora: fp16. This is peft's ``result.clone() + lora_B(...) * scaling`` in one pass."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    base = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled = (lora * scaling).to(tl.float16).to(tl.float32)  # peft's fp16 `output * scaling`
    tl.store(out_ptr + offs, (base + scaled).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_grad_split_kernel(g_ptr, g16_ptr, gs16_ptr, n, scaling, WRITE_G16: tl.constexpr,
                           BLOCK: tl.constexpr):
    """From the output gradient g (fp32 or fp16): g16 = fp16(g) (grad of the base GEMM output
    and of the fp16 LoRA output) and gs16 = fp16(fp32(g16) * scaling) (grad of lora_B's output).
    g16 is only written when g is not already fp16."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g16 = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float16)
    if WRITE_G16:
        tl.store(g16_ptr + offs, g16, mask=mask)
    tl.store(gs16_ptr + offs, (g16.to(tl.float32) * scaling).to(tl.float16), mask=mask)


@triton.jit
def lora_grad_sum_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = fp32(a) + fp32(b) in out's dtype: the input gradient of the base path plus that of
    the LoRA path (both fp16), summed as autograd sums their casts."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


def _grid_block(n: int, device: torch.device):
    block = GPU_BLOCK if device.type == "cuda" else INTERPRETER_BLOCK
    return (triton.cdiv(n, block),), block


def lora_combine(base16: torch.Tensor, lora16: torch.Tensor, scaling: float, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(base16.shape, dtype=out_dtype, device=base16.device)
    n = out.numel()
    grid, block = _grid_block(n, out.device)
    lora_combine_kernel[grid](base16, lora16, out, n, float(scaling), BLOCK=block,
                              num_warps=GPU_NUM_WARPS, enable_fp_fusion=False)
    record("lora_combine")
    return out


def lora_grad_split(g: torch.Tensor, scaling: float):
    """Returns (g16, gs16); g16 is g itself when g is fp16."""
    write_g16 = g.dtype != torch.float16
    g16 = torch.empty(g.shape, dtype=torch.float16, device=g.device) if write_g16 else g
    gs16 = torch.empty(g.shape, dtype=torch.float16, device=g.device)
    n = g.numel()
    grid, block = _grid_block(n, g.device)
    lora_grad_split_kernel[grid](g, g16, gs16, n, float(scaling), WRITE_G16=write_g16, BLOCK=block,
                                 num_warps=GPU_NUM_WARPS, enable_fp_fusion=False)
    record("lora_grad_split")
    return g16, gs16


def lora_grad_sum(a16: torch.Tensor, b16: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(a16.shape, dtype=out_dtype, device=a16.device)
    n = out.numel()
    grid, block = _grid_block(n, out.device)
    lora_grad_sum_kernel[grid](a16, b16, out, n, BLOCK=block, num_warps=GPU_NUM_WARPS)
    record("lora_grad_sum")
    return out


class LoraNF4Function(torch.autograd.Function):
    """out = fp32(F.linear(x16, dequant(W), bias16)) + fp32(fp16(F.linear(F.linear(xd16, A16), B16) * s))

    x: layer input (fp32 or fp16). xd: dropout(x) from torch's dropout, or None when the adapter
    has no dropout (then x16 feeds lora_A too). lora_a [r, in], lora_b [out, r]: trainable, any
    float dtype (cast to fp16 as autocast does). bias16: the base bias, fp16 (bnb casts it), or
    None. weight / quant_state: the frozen packed NF4 weight. Output dtype: x.dtype.
    """

    @staticmethod
    def forward(ctx, x, xd, lora_a, lora_b, bias16, weight, quant_state, scaling):
        x16 = x.to(torch.float16)
        base16 = F.linear(x16, dequantize_to_scratch(weight, quant_state), bias16)
        xd16 = x16 if xd is None else xd.to(torch.float16)
        h16 = F.linear(xd16, lora_a.to(torch.float16))
        lora16 = F.linear(h16, lora_b.to(torch.float16))
        out = lora_combine(base16, lora16, scaling, x.dtype)
        ctx.save_for_backward(xd16, h16, lora_a, lora_b)
        ctx.weight, ctx.quant_state, ctx.scaling = weight, quant_state, scaling
        ctx.x_dtype = x.dtype
        ctx.xd_dtype = None if xd is None else xd.dtype
        ctx.bias_dtype = None if bias16 is None else bias16.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        xd16, h16, lora_a, lora_b = ctx.saved_tensors
        need_x, need_xd, need_a, need_b, need_bias = ctx.needs_input_grad[:5]
        g16, gs16 = lora_grad_split(grad_out.contiguous(), ctx.scaling)
        n_out, r, n_in = gs16.shape[-1], h16.shape[-1], xd16.shape[-1]
        lora_input_needed = need_xd or (need_x and ctx.xd_dtype is None)

        grad_x = grad_xd = grad_a = grad_b = grad_bias = None
        if need_b:  # lora_B: grad_weight = gs^T h
            grad_b = gs16.reshape(-1, n_out).t().mm(h16.reshape(-1, r)).to(lora_b.dtype)
        grad_xd16 = None
        if need_a or lora_input_needed:
            grad_h16 = torch.matmul(gs16, lora_b.to(torch.float16))  # [..., r]
            if need_a:  # lora_A: grad_weight = grad_h^T xd16
                grad_a = grad_h16.reshape(-1, r).t().mm(xd16.reshape(-1, n_in)).to(lora_a.dtype)
            if lora_input_needed:
                grad_xd16 = torch.matmul(grad_h16, lora_a.to(torch.float16))
        if need_x:
            qs = ctx.quant_state
            w16 = dequantize_to_scratch(ctx.weight, qs, rounding_dtype=qs.dtype)
            grad_base16 = torch.matmul(g16, w16)
            if ctx.xd_dtype is None:
                grad_x = lora_grad_sum(grad_base16, grad_xd16, ctx.x_dtype)
            else:
                grad_x = grad_base16.to(ctx.x_dtype)
        if need_xd:
            grad_xd = grad_xd16.to(ctx.xd_dtype)
        if need_bias:
            grad_bias = g16.reshape(-1, n_out).sum(0, dtype=ctx.bias_dtype)
        return grad_x, grad_xd, grad_a, grad_b, grad_bias, None, None, None


def lora_nf4(x, xd, lora_a, lora_b, bias16, weight, quant_state, scaling: float) -> torch.Tensor:
    """See LoraNF4Function. x fp32/fp16 [..., in]; returns x.dtype [..., out]."""
    return LoraNF4Function.apply(x, xd, lora_a, lora_b, bias16, weight, quant_state, float(scaling))


def sm75_specs():
    """Launch configurations used in training (x fp32 -> fp32 output; fp16 for completeness)."""
    for out_ty in ("fp32", "fp16"):
        yield {
            "name": f"lora_combine(out={out_ty})", "fn": lora_combine_kernel,
            "signature": {"base_ptr": "*fp16", "lora_ptr": "*fp16", "out_ptr": f"*{out_ty}", "n": "i32",
                          "scaling": "fp32", "BLOCK": "constexpr"},
            "constexprs": {"BLOCK": GPU_BLOCK}, "num_warps": GPU_NUM_WARPS,
        }
        yield {
            "name": f"lora_grad_split(g={out_ty})", "fn": lora_grad_split_kernel,
            "signature": {"g_ptr": f"*{out_ty}", "g16_ptr": "*fp16", "gs16_ptr": "*fp16", "n": "i32",
                          "scaling": "fp32", "WRITE_G16": "constexpr", "BLOCK": "constexpr"},
            "constexprs": {"WRITE_G16": out_ty != "fp16", "BLOCK": GPU_BLOCK}, "num_warps": GPU_NUM_WARPS,
        }
        yield {
            "name": f"lora_grad_sum(out={out_ty})", "fn": lora_grad_sum_kernel,
            "signature": {"a_ptr": "*fp16", "b_ptr": "*fp16", "out_ptr": f"*{out_ty}", "n": "i32",
                          "BLOCK": "constexpr"},
            "constexprs": {"BLOCK": GPU_BLOCK}, "num_warps": GPU_NUM_WARPS,
        }
