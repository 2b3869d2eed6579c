"""fp32 sums of fp16 / fp32 tensors in one pass: ``add_as_fp32(a, b)`` = fp32(a) + fp32(b), a new
fp32 tensor, no autograd (the fused MLP backward's input-gradient sum; the decoder layer's residual
add). Inputs: same shape, contiguous, fp16 / fp32 each; other inputs take torch's ops.
What it replaces, why, risks, measurements: docs/kernels/fp32_add.md.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from solution.kernels._blocks import load_block, store_block
from solution.kernels._device import runs_here
from solution.kernels._launches import cdiv, launch

GPU_BLOCK = 2048
GPU_NUM_WARPS = 4
INTERPRETER_BLOCK = 1 << 16


@triton.jit
def _add(offs, mask, a_ptr, b_ptr, out_ptr, MASKED: tl.constexpr):
    a = load_block(a_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    b = load_block(b_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    store_block(out_ptr + offs, a + b, mask, MASKED)


@triton.jit(do_not_specialize=["n"])
def fp32_add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[i] = fp32(a[i]) + fp32(b[i]) over contiguous tensors of n elements (whole blocks
    unmasked, the last one masked: kernels/_blocks.py)."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    if start + BLOCK <= n:
        _add(offs, mask, a_ptr, b_ptr, out_ptr, False)
    else:
        _add(offs, mask, a_ptr, b_ptr, out_ptr, True)


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, fp16 / fp32, contiguous, on a device our kernels run on."""
    ok = (torch.float16, torch.float32)
    return (runs_here(a.device) and a.shape == b.shape and a.dtype in ok and b.dtype in ok and a.device == b.device
            and a.is_contiguous() and b.is_contiguous() and a.numel() > 0)


def add_as_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32(a) + fp32(b) as a new fp32 tensor (no autograd); torch's ops for unsupported inputs."""
    if not supported(a, b):
        return a.to(torch.float32) + b
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = out.numel()
    block = GPU_BLOCK if out.device.type == "cuda" else INTERPRETER_BLOCK
    launch(fp32_add_kernel, (cdiv(n, block),), "fp32_add_kernel", a, b, out, n, block, num_warps=GPU_NUM_WARPS)
    return out


def sm75_specs():
    for a, b in (("fp16", "fp16"), ("fp32", "fp16")):
        yield {"name": f"fp32_add({a}+{b})", "fn": fp32_add_kernel, "num_warps": GPU_NUM_WARPS,
               "signature": {"a_ptr": f"*{a}", "b_ptr": f"*{b}", "out_ptr": "*fp32", "n": "i32",
                             "BLOCK": "constexpr"},
               "constexprs": {"BLOCK": GPU_BLOCK}}
