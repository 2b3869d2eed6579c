"""qkv_grad_sum (solution/kernels/qkv_grad.py): the input gradient of q_proj, k_proj and v_proj
summed in one pass, against formulas written here (independent of the project's other kernels):

* an fp32 PyTorch formula in the order autograd runs the three projections' backward: per LoRA
  projection fp32(base) + dropout's backward of fp32(LoRA part) (native_dropout's
  (keep * g) * scale, or the CPU's g * noise), k's fp16 -> fp32 cast, then ((v + k) + q). The
  kernel runs the same fp32 operations unfused: equal bits, at odd sizes, block boundaries and
  with fp16's extremes;
* the fp64 value of the same sum, within the bound of recursive fp32 summation (``test_fp64``).
"""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _launches
from solution.kernels.qkv_grad import qkv_grad_sum

NO_DROPOUT, DROPOUT_MASK, DROPOUT_NOISE = 0, 1, 2  # the kernel's DROP modes
P = 0.3  # dropout probability
U32 = 2.0 ** -24  # fp32 unit roundoff


def _scale(drop_mode):
    """native_dropout's scale 1 / (1 - p), computed in fp32 (1.0 for the other modes)."""
    if drop_mode != DROPOUT_MASK:
        return 1.0
    return (torch.tensor(1.0) / torch.tensor(1.0 - P)).item()


def _parts(n, device, drop_mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(n, generator=g) * s).half().to(device) for s in (1, 3, 0.5, 2, 7)]
    extremes = torch.tensor([65504.0, -65504.0, 6e-8, -0.0], dtype=torch.float16, device=device)
    parts[0][:4] = extremes[:min(n, 4)]  # fp16's largest, smallest subnormal, signed zero
    masks = [None, None]
    if drop_mode == DROPOUT_MASK:
        masks = [(torch.rand(n, generator=g) > P).to(device) for _ in range(2)]
    elif drop_mode == DROPOUT_NOISE:
        masks = [((torch.rand(n, generator=g) > P).float() / (1 - P)).to(device) for _ in range(2)]
    return parts, masks


def _projection32(a, b, m, drop_mode, scale):
    """One LoRA projection's fp32 input gradient: base part + dropout's backward of the LoRA part."""
    g = b.float()
    if drop_mode == DROPOUT_MASK:
        g = (m.float() * g) * torch.tensor(scale, dtype=torch.float32, device=g.device)
    elif drop_mode == DROPOUT_NOISE:
        g = g * m
    return a.float() + g


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 3 * 2048 + 5])
@pytest.mark.parametrize("drop_mode", [NO_DROPOUT, DROPOUT_MASK, DROPOUT_NOISE])
def test_same_bits_as_fp32_formula(device, n, drop_mode):
    (aq, bq, ak, av, bv), (mq, mv) = _parts(n, device, drop_mode, seed=n)
    scale = _scale(drop_mode)
    gq = _projection32(aq, bq, mq, drop_mode, scale)
    gv = _projection32(av, bv, mv, drop_mode, scale)
    ref = (gv + ak.float()) + gq  # autograd: v's gradient first, then k's, then q's
    before = _launches.LAUNCHES["qkv_grad_sum"]
    out = qkv_grad_sum(aq, bq, mq, ak, av, bv, mv, drop_mode, scale)
    assert _launches.LAUNCHES["qkv_grad_sum"] == before + 1
    assert out.dtype == torch.float32 and out.shape == aq.shape
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))  # the bits, a zero's sign too


@pytest.mark.parametrize("drop_mode", [NO_DROPOUT, DROPOUT_MASK, DROPOUT_NOISE])
def test_fp64(device, drop_mode):
    """Against fp64 (scale 1 / (1 - p) exact): the five terms (fp16 inputs, exact in fp32) go
    through at most 6 roundings of relative U32 each (the scale's two: 1 - p to fp32 and the
    division; the scale product; the per-projection sum; the two sums of the three projections),
    so |ours - ref64| <= 6 U32 (1 + 6 U32) sum |term| (recursive summation's bound gamma_6; the
    noise is the fp32 value that multiplies, so it adds no rounding of its own)."""
    n = 4099
    (aq, bq, ak, av, bv), (mq, mv) = _parts(n, device, drop_mode, seed=1)
    p = 1.0 / (1.0 - P)
    out = qkv_grad_sum(aq, bq, mq, ak, av, bv, mv, drop_mode, _scale(drop_mode)).double().cpu()

    def lora64(b, m):
        b = b.double().cpu()
        if drop_mode == DROPOUT_MASK:
            return b * m.double().cpu() * p
        if drop_mode == DROPOUT_NOISE:
            return b * m.double().cpu()
        return b

    terms = [av.double().cpu(), lora64(bv, mv), ak.double().cpu(), aq.double().cpu(), lora64(bq, mq)]
    ref = sum(terms)
    bound = 6 * U32 * (1 + 6 * U32) * sum(t.abs() for t in terms)
    assert ((out - ref).abs() <= bound).all(), ((out - ref).abs() / bound).max().item()
