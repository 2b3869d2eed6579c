"""qkv_rope (solution/kernels/qkv_rope.py), the decoder-layer node's way in and out of attention,
against the module path's launches it replaces: forward lora_combine (q, v), k's fp32 cast, RoPE (rope._launch), the three pad launches
(attn_layout._launch_pad: KV heads repeated, fp16); backward the three unpad launches (fp32, KV
head sums), RoPE's backward and the fp16 casts of the dequantization launches (g16 and
fp16(g16 * scaling)). The same fp32 operations in the same order: the same bits, at odd token
counts, with extreme values, non-contiguous attention gradients and both k cases."""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _launches, attn_layout, lora_nf4, qkv_rope, rope
from solution.step.packing import Unpadded, packed_layout


def _layout(n, device):
    ar = torch.arange(n, device=device)
    return packed_layout(Unpadded(idx=ar, positions=ar, src=ar, batch=1, seqlen=n, lengths=(n,), arange=ar))


def _cos_sin(n, d, device, seed):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, d // 2, generator=g) * 50
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos()[None].to(device), ang.sin()[None].to(device)


def _f16(shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).half()


def _bits_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return torch.equal(a.contiguous().view(torch.int16 if a.dtype == torch.float16 else torch.int32),
                       b.contiguous().view(torch.int16 if b.dtype == torch.float16 else torch.int32))


def _reference_forward(bq, lq, sq, bk, bv, lv, sv, cos, sin, hq, hk, d, layout):
    """The node's former sequence: lora_combine, k.to(fp32), rope, three pads."""
    n = cos.shape[1]
    q = lora_nf4.lora_combine(bq, lq, sq, torch.float32)
    k = bk.to(torch.float32)
    v = lora_nf4.lora_combine(bv, lv, sv, torch.float32)
    qt = q.view(1, n, hq, d).transpose(1, 2)
    kt = k.view(1, n, hk, d).transpose(1, 2)
    q_e, k_e = torch.empty_like(qt), torch.empty_like(kt)
    rope._launch(qt, kt, q_e, k_e, cos, sin, backward=False)
    vt = v.view(1, n, hk, d).transpose(1, 2)
    rep = hq // hk
    qp = attn_layout._launch_pad(q_e.squeeze(0).transpose(0, 1), layout, 1, torch.float16).transpose(1, 2)
    kp = attn_layout._launch_pad(k_e.squeeze(0).transpose(0, 1), layout, rep, torch.float16).transpose(1, 2)
    vp = attn_layout._launch_pad(vt.squeeze(0).transpose(0, 1), layout, rep, torch.float16).transpose(1, 2)
    return qp, kp, vp


def _reference_backward(dq, dk, dv, cos, sin, sq, sv, hk, need_k, layout):
    """The node's former sequence: three unpads (fp32), RoPE's backward, the fp16 casts."""
    _, n, hq, d = dq.shape
    rep = hq // hk
    dv_rows = attn_layout._launch_unpad(dv.transpose(1, 2), layout, rep, torch.float32)
    dk_rows = attn_layout._launch_unpad(dk.transpose(1, 2), layout, rep, torch.float32) if need_k else None
    dq_rows = attn_layout._launch_unpad(dq.transpose(1, 2), layout, 1, torch.float32)
    gq = torch.empty_strided((1, hq, n, d), (n * hq * d, d, hq * d, 1), dtype=torch.float32, device=dq.device)
    gk = torch.empty_strided((1, hk, n, d), (n * hk * d, d, hk * d, 1), dtype=torch.float32,
                             device=dq.device) if need_k else None
    rope._launch(dq_rows.transpose(0, 1).unsqueeze(0), dk_rows.transpose(0, 1).unsqueeze(0) if need_k else None,
                 gq, gk, cos, sin, backward=True)
    q32 = gq.transpose(1, 2).reshape(1, n, -1)
    v32 = dv_rows.view(1, n, -1)
    q16 = q32.half()
    v16 = v32.half()
    k16 = gk.transpose(1, 2).reshape(1, n, -1).half() if need_k else None
    # the dequantization launch's CAST_B 2: fp16(fp32(g16) * scaling)
    return q16, (q16.float() * sq).half(), k16, v16, (v16.float() * sv).half()


# the LoRA output 65504 * 2 overflows fp16 to inf on purpose: on the CPU, Triton's interpreter
# casts with numpy, which warns "overflow encountered in cast" for it
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("n", [1, 7, 64, 133])
@pytest.mark.parametrize("heads", [(12, 2, 16), (4, 4, 8), (6, 3, 32)])
def test_forward_same_bits_as_combine_rope_pad(device, n, heads):
    hq, hk, d = heads
    g = torch.Generator().manual_seed(n * 31 + hq)
    bq, lq = _f16((1, n, hq * d), g, 2.0), _f16((1, n, hq * d), g, 8.0)
    bk = _f16((1, n, hk * d), g, 3.0)
    bv, lv = _f16((1, n, hk * d), g), _f16((1, n, hk * d), g, 30.0)
    bq[0, 0, :3] = torch.tensor([65504.0, -65504.0, 6e-8])  # fp16's extremes pass through fp32
    lv[0, -1, :2] = torch.tensor([65504.0, -0.0])  # the scaled LoRA output overflows fp16 to inf
    bq, lq, bk, bv, lv = (t.to(device) for t in (bq, lq, bk, bv, lv))
    cos, sin = _cos_sin(n, d, device, seed=n)
    sq, sv = 2.0, 2.0
    layout = _layout(n, device)
    ref = _reference_forward(bq, lq, sq, bk, bv, lv, sv, cos, sin, hq, hk, d, layout)
    before = _launches.LAUNCHES["qkv_rope_pad"]
    out = qkv_rope.forward(bq, lq, sq, bk, bv, lv, sv, cos, sin, hq, hk, d)
    assert _launches.LAUNCHES["qkv_rope_pad"] == before + 1
    for name, a, b in zip("qkv", out, ref):
        assert a.is_contiguous() and a.shape == (1, n, hq, d), name
        assert _bits_equal(a, b), name


# the gradient holds 65504 (fp16's largest value): its products (RoPE, the LoRA scaling 2.0)
# overflow fp16 to inf on purpose; on the CPU, Triton's interpreter casts with numpy, which warns
# "overflow encountered in cast" for them
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("n", [1, 9, 130])
@pytest.mark.parametrize("need_k", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_backward_same_bits_as_unpad_rope_casts(device, n, need_k, strided):
    hq, hk, d = 12, 2, 16
    g = torch.Generator().manual_seed(n + 7 * need_k + 3 * strided)
    grads = [_f16((1, n, hq, d), g, s) for s in (1.0, 4.0, 0.5)]
    grads[0][0, 0, 0, :2] = torch.tensor([65504.0, -0.0])
    for t in grads:  # a head of -0.0 everywhere: the old path's sums from 0.0 gave +0.0
        t[0, -1, 1] = -0.0
    grads = [t.to(device) for t in grads]
    if strided:  # [1, N, H, D] views of [1, H, N, D] memory (what a BHSD kernel output would give)
        grads = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in grads]
    dq, dk, dv = grads
    cos, sin = _cos_sin(n, d, device, seed=n + 1)
    sq, sv = 2.0, 0.5
    ref = _reference_backward(dq, dk, dv, cos, sin, sq, sv, hk, need_k, _layout(n, device))
    before = _launches.LAUNCHES["qkv_rope_unpad"]
    out = qkv_rope.backward(dq, dk, dv, cos, sin, sq, sv, hk, need_k)
    assert _launches.LAUNCHES["qkv_rope_unpad"] == before + 1
    for name, a, b in zip(("gq", "gsq", "gk", "gv", "gsv"), out, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.is_contiguous(), name
        assert _bits_equal(a, b), name


def test_supported_shapes(device):
    cos = torch.zeros(1, 5, 128, device=device)
    assert qkv_rope.supported(128, cos)
    assert not qkv_rope.supported(96, torch.zeros(1, 5, 96, device=device))  # half 48: not a power of two
    assert not qkv_rope.supported(128, cos.to(torch.bfloat16))
    assert not qkv_rope.supported(128, torch.zeros(1, 5, 256, device=device)[..., ::2])  # strided


def test_empty_batch(device):
    cos = torch.zeros(1, 0, 16, device=device)
    z = torch.zeros(1, 0, 32, dtype=torch.float16, device=device)
    qp, kp, vp = qkv_rope.forward(z, z, 2.0, z[..., :16], z[..., :16], z[..., :16], 2.0, cos, cos, 2, 1, 16)
    assert qp.shape == kp.shape == vp.shape == (1, 0, 2, 16)
