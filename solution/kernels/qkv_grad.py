"""The input gradient of q_proj, k_proj and v_proj (one normed x, three projections) in one pass:
``qkv_grad_sum`` reads the five fp16 partial gradients (q base, q LoRA, k, v base, v LoRA) and the
two dropout masks and writes x's fp32 gradient with autograd's fp32 operations in its order: per
LoRA part ``(keep * g) * scale`` (native_dropout's backward), ``a + g``, then ``(v + k) + q``;
``enable_fp_fusion=False``, so no FMA changes a rounding.
What it replaces, why, risks, measurements: docs/kernels/qkv_grad.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels._blocks import load_block, store_block
from solution.kernels._launches import cdiv, launch

GPU_BLOCK = 2048
GPU_NUM_WARPS = 8
INTERPRETER_BLOCK = 1 << 16


@triton.jit
def _lora_part(a_ptr, b_ptr, m_ptr, offs, mask, drop_scale, DROP: tl.constexpr, MASKED: tl.constexpr):
    """fp32(a) + dropout_backward(fp32(b)) in fp32: autograd's value for an fp32 x."""
    a = load_block(a_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    g = load_block(b_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    if DROP == 1:
        keep = load_block(m_ptr + offs, mask, 0, MASKED).to(tl.float32)
        g = (keep * g) * drop_scale
    if DROP == 2:
        g = g * load_block(m_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    return a + g


@triton.jit
def _qkv_sum(offs, mask, aq_ptr, bq_ptr, mq_ptr, ak_ptr, av_ptr, bv_ptr, mv_ptr, out_ptr, drop_scale,
             DROP: tl.constexpr, MASKED: tl.constexpr):
    gq = _lora_part(aq_ptr, bq_ptr, mq_ptr, offs, mask, drop_scale, DROP, MASKED)
    gv = _lora_part(av_ptr, bv_ptr, mv_ptr, offs, mask, drop_scale, DROP, MASKED)
    gk = load_block(ak_ptr + offs, mask, 0.0, MASKED).to(tl.float32)
    store_block(out_ptr + offs, (gv + gk) + gq, mask, MASKED)  # autograd's ((v + k) + q)


@triton.jit(do_not_specialize=["n"])
def qkv_grad_sum_kernel(aq_ptr, bq_ptr, mq_ptr, ak_ptr, av_ptr, bv_ptr, mv_ptr, out_ptr, n, drop_scale,
                        DROP: tl.constexpr, BLOCK: tl.constexpr):
    """x's fp32 gradient from q (a_q, b_q, mask m_q), k (a_k), v (a_v, b_v, m_v); DROP: 0 none,
    1 bool mask, 2 noise. Whole blocks unmasked, the last one masked (kernels/_blocks.py)."""
    start = tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    if start + BLOCK <= n:
        _qkv_sum(offs, mask, aq_ptr, bq_ptr, mq_ptr, ak_ptr, av_ptr, bv_ptr, mv_ptr, out_ptr, drop_scale, DROP, False)
    else:
        _qkv_sum(offs, mask, aq_ptr, bq_ptr, mq_ptr, ak_ptr, av_ptr, bv_ptr, mv_ptr, out_ptr, drop_scale, DROP, True)


def qkv_grad_sum(aq, bq, mq, ak, av, bv, mv, drop_mode: int, drop_scale: float) -> torch.Tensor:
    """fp32 ((v + k) + q) of the partial gradients (fp16, contiguous, one shape; the masks: bool or
    the noise tensor, None without dropout), as a new fp32 tensor of that shape."""
    out = torch.empty(aq.shape, dtype=torch.float32, device=aq.device)
    n = out.numel()
    block = GPU_BLOCK if out.device.type == "cuda" else INTERPRETER_BLOCK
    mq_ = aq if mq is None else mq
    mv_ = av if mv is None else mv
    ptrs = (aq, bq, mq_, ak, av, bv, mv_, out)
    launch(qkv_grad_sum_kernel, (cdiv(n, block),), "qkv_grad_sum", *ptrs, n, float(drop_scale), drop_mode, block,
           num_warps=GPU_NUM_WARPS, enable_fp_fusion=False)
    return out


def sm75_specs():
    """The launch configurations training uses: dropout on CUDA (bool masks) or none."""
    for drop, m_ty in ((0, "*fp16"), (1, "*i1")):
        yield {
            "name": f"qkv_grad_sum(drop={drop})", "fn": qkv_grad_sum_kernel,
            "signature": {"aq_ptr": "*fp16", "bq_ptr": "*fp16", "mq_ptr": m_ty, "ak_ptr": "*fp16",
                          "av_ptr": "*fp16", "bv_ptr": "*fp16", "mv_ptr": m_ty, "out_ptr": "*fp32", "n": "i32",
                          "drop_scale": "fp32", "DROP": "constexpr", "BLOCK": "constexpr"},
            "constexprs": {"DROP": drop, "BLOCK": GPU_BLOCK}, "num_warps": GPU_NUM_WARPS,
            "options": {"enable_fp_fusion": False},
        }
