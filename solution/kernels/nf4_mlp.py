"""The frozen NF4 MLP block of Qwen2 (gate_proj, up_proj, SwiGLU, down_proj, all bnb NF4 without
LoRA) as the decoder-layer node (solution/step/layer.py) runs it: forward and backward that keep the
gate / up outputs in fp16, and a memory policy that chooses what the backward gets: the saved gate /
up outputs, or the block's input to recompute them.

What it replaces. In the workload the residual stream is fp32 (prepare_model_for_kbit_training
makes the norms fp32), so bnb's Linear4bit casts its fp16 GEMM output back to fp32. Stock, per MLP
call and token:
    g = fp32(x16 @ Wg), u = fp32(x16 @ Wu)        two fp32 [T, 8960] tensors, SAVED for backward
    h = silu(g) * u                                fp32, then cast to fp16 for down_proj
    backward: dh fp16 -> fp32 cast, fp32 SwiGLU backward, dg / du fp32 -> two fp16 casts, two
    dX GEMMs, two fp16 -> fp32 casts and an fp32 add
The two saved fp32 tensors were the largest item at the solution's memory peak (the
measurement: docs/kernels/nf4_mlp.md, section 2).

Why that is wasteful: g and u are fp16 GEMM outputs; their fp32 copies hold fp16 values exactly.
Storing them as fp16 loses nothing, as long as every later step computes what stock computes on
the fp32 copies. So here:
    x16 = fp16(x)   (one cast, fused into the gate weight's dequantization launch; stock casts x
                     once per projection)
    g16 = x16 @ Wg, u16 = x16 @ Wu                 kept fp16 (saved: half the bytes)
    h16 = fp16(fp32 silu(g) * u)                   swiglu.py: stock's fp32 math, then the fp16
                                                   cast down_proj makes
    y16 = h16 @ Wd                                 returned in fp16; the caller's residual add
                                                   promotes it to fp32, the same values as stock's
                                                   fp32 copy
    backward: dh16 = dy16 @ Wd; swiglu backward in fp32 math writing fp16(dg), fp16(du) in place
    (the casts the gate / up backward make); dx = fp32(dg16 @ Wg) + fp32(du16 @ Wu) (the fp32 sum
    autograd makes of the two projections' input gradients; the sum is commutative, so the order
    does not matter).
Every rounding is stock's: the same numbers where the GPU gives the same GEMM kernels, within fp16
noise otherwise (tests/test_nf4_mlp.py).

The memory policy (SOLUTION_MEMORY_POLICY, read by apply(), kept in each layer's plan and passed to
``mlp_saved`` / ``mlp_backward`` by the node):
  "speed" (default): save g16 and u16 (2 x T x 8960 x 2 bytes per layer).
  "balanced": save x16 and g16 (T x (1536 + 8960) x 2 bytes, 1.7x less) and recompute u16 in
      backward: one more NF4 dequantization and GEMM per layer.
  "memory": save only x16 (T x 1536 x 2 bytes per layer, 11.7x less) and recompute g16 and u16 in
      backward: two more NF4 dequantizations and GEMMs per layer.
  The recomputed values are the forward's bit for bit: the same kernels on the same inputs.
Any other value makes apply() raise a clear error before it installs anything; apply() reports
the policy in use.

Correctness risks: (1) the backward overwrites the saved g16 / u16 with dg / du; a second backward
through the same graph (retain_graph=True) would read gradients as activations, so the node raises
instead. (2) Only for fp32 inputs (the workload's; the node's planner refuses others). (3) The three
projections must be plain bnb Linear4bit layers with no hooks and no bias (the planner,
solution/patches/qwen2_layer_node.py, checks it).
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
    """The block's input gradient (2-D fp32 [T, H]) from its output gradient ``dy2`` (2-D, fp32 or
    fp16; an fp32 gradient is cast to fp16 in the down weight's dequantization launch, the bits
    autograd's cast gives) and the tensors ``mlp_saved`` kept. Overwrites the saved g16 / u16."""
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
    # one Triton pass for fp32(dxg) + fp32(dxu): the fp32 sum autograd makes of the two projections'
    # input gradients (fp32_add.py)
    return fp32_add.add_as_fp32(dxg, up.input_grad16(u16))
