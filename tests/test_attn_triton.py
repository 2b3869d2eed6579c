"""Our Triton causal attention for packed rows with grouped KV heads (solution/kernels/attn_triton.py).

Reference: fp64 attention of the same fp16 inputs, row by row (block-diagonal causal), K/V heads
shared by Hq / Hkv query heads. Tolerance: the kernel rounds P and dS to fp16 before their
products and stores fp16 results, so per element it is within a few fp16 ulps of values of size
~1: atol 1e-2 on the gradients (sums of up to a few hundred such products), 4e-3 on the output,
and the relative Frobenius error below 5e-3. The CPU interpreter runs small shapes (head dim 16
and 32); the GPU test runs the model's (12 / 2 heads, head dim 128, rows up to 512).
"""
import pytest
import torch

from solution.kernels import _launches, attn_triton
from tests.conftest import HAS_CUDA, rel_err


def _inputs(lengths, hq, hkv, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, hq, d, generator=g).half().to(device)
    k = torch.randn(n, hkv, d, generator=g).half().to(device)
    v = torch.randn(n, hkv, d, generator=g).half().to(device)
    do = torch.randn(n, hq, d, generator=g).half().to(device)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    return q, k, v, do, cu


def _reference(q, k, v, do, lengths, scale):
    """fp64 output and gradients (dq, dk, dv)."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for length in lengths:
        sl = slice(start, start + length)
        qs = q64[sl].transpose(0, 1)  # [Hq, L, D]
        ks = k64[sl].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v64[sl].repeat_interleave(rep, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        start += length
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q64, k64, v64), do.double().cpu())
    return out.detach(), grads


def _run(q, k, v, do, cu, lengths, scale):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attn_triton.triton_varlen_attention(q, k, v, cu, max(lengths), scale)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out, grads


def _assert_close_to_reference(out, grads, ref, ref_grads):
    assert out.dtype == torch.float16 and all(g.dtype == torch.float16 for g in grads)
    torch.testing.assert_close(out.double().cpu(), ref, atol=4e-3, rtol=4e-3)
    assert rel_err(out, ref) < 5e-3
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(a.double().cpu(), b, atol=1e-2, rtol=1e-2, msg=name)
        assert rel_err(a, b) < 5e-3, name


@pytest.mark.parametrize("lengths,hq,hkv,d", [
    ([7, 20, 1, 33], 4, 2, 16),   # odd lengths, a row of one token, 2 query heads per KV head
    ([16, 5, 40], 2, 2, 32),      # no grouping, a length that is a multiple of the blocks
    ([1], 3, 1, 16),              # one token, 3 query heads on one KV head
])
def test_matches_fp64_reference(device, lengths, hq, hkv, d):
    q, k, v, do, cu = _inputs(lengths, hq, hkv, d, device)
    scale = d ** -0.5
    _launches.reset()
    out, grads = _run(q, k, v, do, cu, lengths, scale)
    ref, ref_grads = _reference(q, k, v, do, lengths, scale)
    _assert_close_to_reference(out, grads, ref, ref_grads)
    assert _launches.LAUNCHES["_attn_fwd_kernel"] == 1 and _launches.LAUNCHES["_attn_bwd_dkdv_kernel"] == 1


def test_rows_do_not_see_each_other(device):
    """Changing the tokens of one row leaves every other row's output and gradients unchanged."""
    lengths = [9, 17]
    q, k, v, do, cu = _inputs(lengths, 2, 1, 16, device, seed=1)
    out1, g1 = _run(q, k, v, do, cu, lengths, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[:9] += 1.0
    v2[:9] -= 1.0
    out2, g2 = _run(q, k2, v2, do, cu, lengths, 0.25)
    assert torch.equal(out1[9:], out2[9:])
    assert torch.equal(g1[0][9:], g2[0][9:]) and torch.equal(g1[1][9:], g2[1][9:]) and torch.equal(g1[2][9:], g2[2][9:])


def test_bad_shapes_raise_clear_errors(device):
    q = torch.zeros(4, 3, 16, dtype=torch.float16, device=device)
    k = torch.zeros(4, 2, 16, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attn_triton.triton_varlen_attention(q, k, k, cu, 4, 0.25)


def test_supported_and_off_by_default(monkeypatch):
    monkeypatch.delenv("SOLUTION_ATTN_TRITON", raising=False)
    assert not attn_triton.enabled()
    dev = "cuda" if HAS_CUDA else "cpu"
    dev = torch.device(dev)
    assert attn_triton.supported(128, 12, 2, torch.float16, dev)
    assert not attn_triton.supported(128, 12, 2, torch.float32, dev)  # fp16 only
    assert not attn_triton.supported(96, 12, 2, torch.float16, dev)  # head dim not a power of two
    assert not attn_triton.supported(128, 12, 5, torch.float16, dev)  # heads not grouped evenly


@pytest.mark.gpu
def test_gpu_model_shape():
    lengths = [512, 87, 300, 1, 251]
    q, k, v, do, cu = _inputs(lengths, 12, 2, 128, "cuda", seed=5)
    scale = 128 ** -0.5
    out, grads = _run(q, k, v, do, cu, lengths, scale)
    ref, ref_grads = _reference(q, k, v, do, lengths, scale)
    _assert_close_to_reference(out, grads, ref, ref_grads)
    out2, grads2 = _run(q, k, v, do, cu, lengths, scale)  # no atomics: the same bits again
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_sdpa_unpadded_uses_it_when_asked(device, monkeypatch):
    """Through the model's attention function (attention.sdpa_unpadded) with fp16 q / k / v in
    the [1, heads, N, D] layout stock gives it: SOLUTION_ATTN_TRITON=1 runs our kernel (KV heads
    not repeated), and output and gradients match the fp64 reference like the kernel alone."""
    from solution.step import packing
    from solution.step import attention

    class Attn:
        num_key_value_groups = 2

    lengths = [5, 18, 1]
    info = packing.make_unpadded(lengths, max(lengths), torch.device(device))
    q0, k0, v0, do, _ = _inputs(lengths, 4, 2, 16, device, seed=7)
    monkeypatch.setenv("SOLUTION_ATTN_TRITON", "1")
    _launches.reset()
    q, k, v = (t.transpose(0, 1).unsqueeze(0).clone().requires_grad_() for t in (q0, k0, v0))  # [1, H, N, D]
    out, _ = attention.sdpa_unpadded(Attn(), q, k, v, info, dropout=0.0, scaling=0.25)
    assert _launches.LAUNCHES["_attn_fwd_kernel"] == 1 and out.shape == (1, sum(lengths), 4, 16)
    grads = [g[0].transpose(0, 1) for g in torch.autograd.grad(out, (q, k, v), do.unsqueeze(0))]
    ref, ref_grads = _reference(q0, k0, v0, do, lengths, 0.25)
    _assert_close_to_reference(out[0], grads, ref, ref_grads)
    monkeypatch.setenv("SOLUTION_ATTN_TRITON", "0")
    _launches.reset()
    attention.sdpa_unpadded(Attn(), q, k, v, info, dropout=0.0, scaling=0.25)
    assert _launches.LAUNCHES["_attn_fwd_kernel"] == 0
