"""qkv_grad_sum (solution/kernels/qkv_grad.py) against what the three projections' backward and
autograd compute one by one: lora_grad_sum for q and v (base part + dropout's backward of the LoRA
part, in fp32), k's fp16 -> fp32 cast, then autograd's ((v + k) + q). The same fp32 operations in
the same order, so the same bits, at odd sizes, block boundaries and with extreme values."""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _launches, lora_nf4
from solution.kernels.qkv_grad import qkv_grad_sum


def _parts(n, device, drop_mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(n, generator=g) * s).half().to(device) for s in (1, 3, 0.5, 2, 7)]
    extremes = torch.tensor([65504.0, -65504.0, 6e-8, -0.0], dtype=torch.float16, device=device)
    parts[0][:4] = extremes[:min(n, 4)]  # fp16's largest, smallest subnormal, signed zero
    masks = [None, None]
    if drop_mode == lora_nf4.DROPOUT_MASK:
        masks = [(torch.rand(n, generator=g) > 0.3).to(device) for _ in range(2)]
    elif drop_mode == lora_nf4.DROPOUT_NOISE:
        masks = [((torch.rand(n, generator=g) > 0.3).float() / 0.7).to(device) for _ in range(2)]
    return parts, masks


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049, 3 * 2048 + 5])
@pytest.mark.parametrize("drop_mode", [lora_nf4.NO_DROPOUT, lora_nf4.DROPOUT_MASK, lora_nf4.DROPOUT_NOISE])
def test_same_bits_as_the_three_layers_and_autograd(device, n, drop_mode):
    (aq, bq, ak, av, bv), (mq, mv) = _parts(n, device, drop_mode, seed=n)
    scale = lora_nf4._native_dropout_scale(0.3) if drop_mode == lora_nf4.DROPOUT_MASK else 1.0
    gq = lora_nf4.lora_grad_sum(aq, bq, mq, drop_mode, scale, torch.float32)
    gv = lora_nf4.lora_grad_sum(av, bv, mv, drop_mode, scale, torch.float32)
    ref = (gv + ak.to(torch.float32)) + gq  # autograd: v's gradient first, then k's, then q's
    before = _launches.LAUNCHES["qkv_grad_sum"]
    out = qkv_grad_sum(aq, bq, mq, ak, av, bv, mv, drop_mode, scale)
    assert _launches.LAUNCHES["qkv_grad_sum"] == before + 1
    assert out.dtype == torch.float32 and out.shape == aq.shape
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


