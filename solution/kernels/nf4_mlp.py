"""The frozen NF4 MLP block of Qwen2 (gate_proj, up_proj, SwiGLU, down_proj; bnb NF4, no LoRA) as the
decoder-layer node runs it, the gate / up outputs kept in fp16 with stock's roundings: ``mlp_forward``
(fp32 x [..., H] -> y16, g16, u16, x16), ``mlp_saved``, ``mlp_backward`` (fp32 dx; it overwrites the
saved g16 / u16, so the node refuses a second backward). The memory policy (SOLUTION_MEMORY_POLICY,
passed by the node) picks what backward keeps: "speed" g16, u16; "balanced" x16, g16 (u16
recomputed); "memory" x16 (both recomputed, the same bits).
What it replaces, why, risks, measurements: docs/kernels/nf4_mlp.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from solution.kernels import fp32_add
from solution.kernels.nf4_linear import LinearPlan
from solution.kernels.swiglu import swiglu_backward_fp16_of_fp32, swiglu_fp16_of_fp32


def mlp_forward(x: torch.Tensor, gate: LinearPlan, up: LinearPlan, down: LinearPlan):
    """(y16 [..., H], g16, u16, x16) for fp32 x [..., H]: the block's forward, kept activations."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    g16, u16, x16 = _gate_up(x2, gate, up)
    h16 = swiglu_fp16_of_fp32(g16, u16)
    wd, _ = down.dequant_and_cast(h16)
    y = F.linear(h16, wd)
    return y.view(*x.shape[:-1], y.shape[-1]), g16, u16, x16


def _gate_up(x2: torch.Tensor, gate: LinearPlan, up: LinearPlan):
    """(g16, u16, x16) for 2-D fp32 x: x cast once, in the gate weight's dequantization launch."""
    wg, x16 = gate.dequant_and_cast(x2)
    g16 = F.linear(x16, wg)
    return g16, _project16(x16, up), x16


def _project16(x16: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """x16 @ W^T for fp16 x16: a dequantization launch (no cast) and the GEMM."""
    w16, _ = plan.dequant_and_cast(x16)
    return F.linear(x16, w16)


def mlp_saved(policy: str, x16, g16, u16) -> tuple:
    """What the backward keeps under ``policy`` (the module doc)."""
    if policy == "memory":
        return (x16,)
    if policy == "balanced":
        return (x16, g16)
    return (g16, u16)


def mlp_backward(plans, policy: str, saved: tuple, dy2: torch.Tensor) -> torch.Tensor:
    """The block's input gradient (fp32 [T, H]) from ``dy2`` (2-D, fp32 or fp16) and what
    ``mlp_saved`` kept. Overwrites the saved g16 / u16."""
    gate, up, down = plans
    if not dy2.is_contiguous():
        dy2 = dy2.contiguous()
    wd, dy16 = down.dequant_and_cast(dy2, down.round_bwd)  # fp16 dy: a dequantization only
    dh16 = torch.matmul(dy16, wd)
    if policy == "memory":
        (x16,) = saved
        g16, u16, _ = _gate_up(x16, gate, up)
    elif policy == "balanced":
        x16, g16 = saved
        u16 = _project16(x16, up)  # the forward's up projection again: the same bits
    else:
        g16, u16 = saved
    swiglu_backward_fp16_of_fp32(dh16, g16, u16, g16, u16)  # dg -> g16, du -> u16, in place
    del dh16
    dxg = gate.input_grad16(g16)
    # the fp32 sum autograd makes of the two projections' input gradients, one pass
    return fp32_add.add_as_fp32(dxg, up.input_grad16(u16))
