"""qkv_rope (solution/kernels/qkv_rope.py), the decoder-layer node's way in and out of attention,
against formulas written here, independent of the project's other kernels:

* fp32 formulas in PyTorch, in the kernel's order of operations: peft's LoRA sum
  fp32(base) + fp32(fp16(fp32(lora) * scaling)), RoPE as transformers writes it
  (q * cos + rotate_half(q) * sin; its backward by autograd through that formula), transformers'
  repeat_kv of the KV heads (its backward: the head copies summed in fp32 from 0.0, in head
  order), and the fp16 casts. The kernel runs the same fp32 operations, unfused: equal bits
  (asserted on the bit patterns, so a zero's sign counts too), at odd token counts, with fp16's
  extremes, overflow to inf, non-contiguous attention gradients and both k cases.
* fp64 formulas (base + scaling * lora, RoPE, repeat_kv, head sums) with an elementwise error
  bound derived from the roundings each value goes through (see ``_bound_*``).
"""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _launches, qkv_rope

U16 = 2.0 ** -11  # fp16 unit roundoff (round to nearest)
U32 = 2.0 ** -24  # fp32 unit roundoff
SUB16 = 2.0 ** -25  # half of fp16's smallest subnormal: a rounding's absolute error near zero


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


def _rotate_half(x):
    """transformers' rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor [N, heads, D]; cos, sin [1, N, D]."""
    c, s = cos[0, :, None, :], sin[0, :, None, :]
    return x * c + _rotate_half(x) * s


def _rope_backward(g, cos, sin):
    """RoPE's input gradient for the upstream gradient g: autograd through ``_rope``."""
    x = torch.zeros_like(g, requires_grad=True)
    (dx,) = torch.autograd.grad(_rope(x, cos, sin), x, g)
    return dx


def _repeat_kv(x, rep):
    """transformers' repeat_kv on [N, heads, D]: head h * rep + g is KV head h."""
    n, h, d = x.shape
    return x[:, :, None, :].expand(n, h, rep, d).reshape(n, h * rep, d)


def _head_sums(x, rep):
    """repeat_kv's backward on [N, heads * rep, D]: the rep copies of each head summed from 0.0 in
    head order (the sequential fp32 sum, in x's dtype)."""
    n, hr, d = x.shape
    x = x.reshape(n, hr // rep, rep, d)
    acc = torch.zeros_like(x[:, :, 0])
    for g in range(rep):
        acc = acc + x[:, :, g]
    return acc


def _lora32(base, lora, scaling):
    """peft's sum on fp16 GEMM outputs, as the workload's autocast computes it."""
    return base.float() + (lora.float() * scaling).half().float()


def _forward32(bq, lq, sq, bk, bv, lv, sv, cos, sin, hq, hk, d):
    n, rep = cos.shape[1], hq // hk
    q = _rope(_lora32(bq, lq, sq).view(n, hq, d), cos, sin).half()
    k = _rope(bk.float().view(n, hk, d), cos, sin).half()
    v = _lora32(bv, lv, sv).view(n, hk, d).half()
    return tuple(t[None] for t in (q, _repeat_kv(k, rep), _repeat_kv(v, rep)))


def _backward32(dq, dk, dv, cos, sin, sq, sv, hk, need_k):
    _, n, hq, d = dq.shape
    rep = hq // hk
    gq = _rope_backward(_head_sums(dq[0].float(), 1), cos, sin).half()
    gk = _rope_backward(_head_sums(dk[0].float(), rep), cos, sin).half() if need_k else None
    gv = _head_sums(dv[0].float(), rep).half()
    flat = lambda t: None if t is None else t.reshape(1, n, -1)  # noqa: E731
    # the LoRA B output's gradient: peft's fp16 ``* scaling``, fp16(fp32(g16) * scaling)
    return (flat(gq), flat((gq.float() * sq).half()), flat(gk), flat(gv), flat((gv.float() * sv).half()))


# the LoRA output 65504 * 2 overflows fp16 to inf on purpose: on the CPU, Triton's interpreter
# casts with numpy, which warns "overflow encountered in cast" for it
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("n", [1, 7, 64, 133])
@pytest.mark.parametrize("heads", [(12, 2, 16), (4, 4, 8), (6, 3, 32), (3, 1, 16)])
def test_forward_same_bits_as_fp32_formula(device, n, heads):
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
    ref = _forward32(bq[0], lq[0], sq, bk[0], bv[0], lv[0], sv, cos, sin, hq, hk, d)
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
def test_backward_same_bits_as_fp32_formula(device, n, need_k, strided):
    hq, hk, d = 12, 2, 16
    g = torch.Generator().manual_seed(n + 7 * need_k + 3 * strided)
    grads = [_f16((1, n, hq, d), g, s) for s in (1.0, 4.0, 0.5)]
    grads[0][0, 0, 0, :2] = torch.tensor([65504.0, -0.0])
    for t in grads:  # a head of -0.0 everywhere: sums from 0.0 give +0.0
        t[0, -1, 1] = -0.0
    grads = [t.to(device) for t in grads]
    if strided:  # [1, N, H, D] views of [1, H, N, D] memory (what a BHSD kernel output would give)
        grads = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in grads]
    dq, dk, dv = grads
    cos, sin = _cos_sin(n, d, device, seed=n + 1)
    sq, sv = 2.0, 0.5
    ref = _backward32(dq, dk, dv, cos, sin, sq, sv, hk, need_k)
    before = _launches.LAUNCHES["qkv_rope_unpad"]
    out = qkv_rope.backward(dq, dk, dv, cos, sin, sq, sv, hk, need_k)
    assert _launches.LAUNCHES["qkv_rope_unpad"] == before + 1
    for name, a, b in zip(("gq", "gsq", "gk", "gv", "gsv"), out, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.is_contiguous(), name
        assert _bits_equal(a, b), name


# --- fp64 formulas with derived elementwise bounds ---------------------------------------------
# Each output element of ours is compared with the fp64 value of the same formula on the same
# fp16 inputs: |ours - ref64| <= bound, where the bound adds up what each rounding can contribute.
# A rounding to fp16 (ours: the scaled LoRA output, the final cast) errs by at most U16 of the
# value rounded, or SUB16 in absolute terms near zero; an fp32 operation by at most U32 of its
# result. Products with cos / sin carry an input error e to at most |cos| e + |sin| e', which
# ``_abs_fwd`` / ``_abs_bwd`` (RoPE on magnitudes) compute. A final factor (1 + 4 U16) covers the
# products of the small terms (second order).


def _abs_fwd(a, cos, sin):
    """RoPE's forward on magnitudes: |x| |cos| + |rotate_half(x)| |sin| for a = |x|."""
    c, s = cos[0, :, None, :].abs().double(), sin[0, :, None, :].abs().double()
    a1, a2 = a.chunk(2, dim=-1)
    return a * c + torch.cat((a2, a1), dim=-1) * s


def _abs_bwd(a, cos, sin):
    """RoPE's backward on magnitudes (the transposed map's)."""
    c, s = cos[0, :, None, :].abs().double(), sin[0, :, None, :].abs().double()
    p1, p2 = (a * s).chunk(2, dim=-1)
    return a * c + torch.cat((p2, p1), dim=-1)


def _assert_within(name, ours, ref64, bound):
    err = (ours.double().cpu() - ref64).abs()
    bound = bound * (1 + 4 * U16)
    worst = (err - bound).max().item()
    assert worst <= 0.0, (name, worst, err.max().item())


@pytest.mark.parametrize("heads", [(3, 1, 16), (6, 2, 8), (12, 2, 16)])
def test_forward_within_rounding_bound_of_fp64(device, heads):
    hq, hk, d = heads
    n, rep = 17, hq // hk
    g = torch.Generator().manual_seed(hq * 7 + d)
    bq, lq = _f16((1, n, hq * d), g, 2.0), _f16((1, n, hq * d), g, 8.0)
    bk = _f16((1, n, hk * d), g, 3.0)
    bv, lv = _f16((1, n, hk * d), g), _f16((1, n, hk * d), g, 30.0)
    cos, sin = _cos_sin(n, d, "cpu", seed=3)
    sq, sv = 0.3, 1.7  # not powers of two: the scaled LoRA output is rounded
    out = qkv_rope.forward(*(t.to(device) for t in (bq, lq)), sq, *(t.to(device) for t in (bk, bv, lv)), sv,
                           cos.to(device), sin.to(device), hq, hk, d)
    b64 = {k: t[0].double() for k, t in dict(bq=bq, lq=lq, bk=bk, bv=bv, lv=lv).items()}
    c64, s64 = cos.double(), sin.double()
    lq_s, lv_s = (sq * b64["lq"]).view(n, hq, d), (sv * b64["lv"]).view(n, hk, d)
    xq = b64["bq"].view(n, hq, d) + lq_s
    xk = b64["bk"].view(n, hk, d)
    xv = b64["bv"].view(n, hk, d) + lv_s
    ref = {"q": _rope(xq, c64, s64), "k": _repeat_kv(_rope(xk, c64, s64), rep), "v": _repeat_kv(xv, rep)}
    # q: scaled LoRA rounded to fp16 (U16, plus U32 for its fp32 product and scaling's own fp32
    # rounding: 2 U32), the sum, RoPE's two products and its sum (4 U32 of the magnitudes), the cast
    q_bound = (U16 * ref["q"].abs() + (U16 + 2 * U32) * _abs_fwd(lq_s.abs(), cos, sin)
               + 4 * U32 * _abs_fwd(xq.abs() + lq_s.abs(), cos, sin) + 3 * SUB16)
    # k: exact fp16 -> fp32, RoPE (3 U32), the cast
    k_bound = _repeat_kv(U16 * _rope(xk, c64, s64).abs() + 3 * U32 * _abs_fwd(xk.abs(), cos, sin) + SUB16, rep)
    # v: the scaled LoRA rounded to fp16, the sum (U32), the cast
    v_bound = _repeat_kv(U16 * xv.abs() + (U16 + 2 * U32) * lv_s.abs() + U32 * (xv.abs() + lv_s.abs())
                         + 2 * SUB16, rep)
    for (name, a), bound in zip(zip("qkv", out), (q_bound, k_bound, v_bound)):
        _assert_within(name, a[0], ref[name], bound)


@pytest.mark.parametrize("heads", [(3, 1, 16), (12, 2, 16)])
@pytest.mark.parametrize("need_k", [True, False])
def test_backward_within_rounding_bound_of_fp64(device, heads, need_k):
    hq, hk, d = heads
    n, rep = 17, hq // hk
    g = torch.Generator().manual_seed(hq + 5 * need_k)
    dq, dk, dv = (_f16((1, n, hq, d), g, s) for s in (1.0, 4.0, 0.5))
    cos, sin = _cos_sin(n, d, "cpu", seed=4)
    sq, sv = 0.3, 1.7
    out = qkv_rope.backward(dq.to(device), dk.to(device), dv.to(device), cos.to(device), sin.to(device),
                            sq, sv, hk, need_k)
    c64, s64 = cos.double(), sin.double()
    dq64, dk64, dv64 = (t[0].double() for t in (dq, dk, dv))
    gq = _rope_backward(dq64, c64, s64)
    gq_bound = U16 * gq.abs() + 3 * U32 * _abs_bwd(dq64.abs(), cos, sin) + SUB16
    sk = _head_sums(dk64, rep)
    gk = _rope_backward(sk, c64, s64)
    # the head sum: rep - 1 fp32 additions, each erring by at most U32 of a partial sum
    gk_bound = (U16 * gk.abs() + (3 + rep - 1) * U32 * _abs_bwd(_head_sums(dk64.abs(), rep), cos, sin) + SUB16)
    gv = _head_sums(dv64, rep)
    gv_bound = U16 * gv.abs() + (rep - 1) * U32 * _head_sums(dv64.abs(), rep) + SUB16
    # the scaled copies: scaling times the unscaled one's error, plus fp32(scaling), the fp32
    # product (2 U32) and the cast (U16)
    refs = [gq, sq * gq, gk, gv, sv * gv]
    bounds = [gq_bound, sq * gq_bound + (U16 + 2 * U32) * sq * gq.abs() + SUB16, gk_bound, gv_bound,
              sv * gv_bound + (U16 + 2 * U32) * sv * gv.abs() + SUB16]
    for name, a, r, bound in zip(("gq", "gsq", "gk", "gv", "gsv"), out, refs, bounds):
        if name == "gk" and not need_k:
            assert a is None
            continue
        _assert_within(name, a.view(n, -1, d), r.reshape(n, -1, d), bound.reshape(n, -1, d))


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
