"""Pad / unpad kernels around attention (solution/kernels/attn_layout.py) against the torch ops
they replace (index_copy into zeros, repeat_kv, the fp16 cast; index_select; and the backward of
each). Data movement is exact; the only arithmetic is the backward's sum over a head group, done in
fp32 like stock's (another order: compared at fp32 rounding, rel 1e-6)."""
from __future__ import annotations

import pytest
import torch

from solution.step import packing
from solution.kernels import attn_layout
from tests.conftest import rel_err

CASES = [([5, 2, 7], 7, 2, 3), ([9, 16, 1, 4], 16, 2, 6), ([3], 4, 12, 1)]  # lengths, seqlen, heads, rep


def _reference_pad(rows, info, rep, out_dtype):
    """What sdpa_unpadded does with torch ops (zeros + index_copy, repeat_kv, autocast's cast)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    n, h, d = rows.shape
    padded = packing.pad_rows(rows, info).view(info.batch, info.seqlen, h, d).transpose(1, 2)
    return repeat_kv(padded, rep).to(out_dtype)


@pytest.mark.parametrize("lengths,seqlen,heads,rep", CASES)
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.float16), (torch.float32, torch.float32),
                                                (torch.float16, torch.float16)])
def test_pad_heads_matches_torch(device, lengths, seqlen, heads, rep, in_dtype, out_dtype):
    info = packing.make_unpadded(lengths, seqlen, torch.device(device))
    n, d = sum(lengths), 64
    # the packed rows as the model has them: a [1, H, N, D] transposed view, read as [N, H, D]
    base = torch.randn(1, n, heads, d, device=device).to(in_dtype)
    rows = base.transpose(1, 2)[0].transpose(0, 1).requires_grad_(False)
    x = rows.clone().requires_grad_()
    x_ref = rows.clone().requires_grad_()
    ours = attn_layout.pad_heads(x, info, rep, out_dtype)
    ref = _reference_pad(x_ref, info, rep, out_dtype)
    assert ours.shape == ref.shape and ours.dtype == out_dtype
    assert torch.equal(ours, ref)
    g = torch.randn(ref.shape, device=device).to(out_dtype)
    for grad in (g, g.contiguous(), g.transpose(1, 2).contiguous().transpose(1, 2), g[..., :]):
        (gx,) = torch.autograd.grad(ours, x, grad, retain_graph=True)
        (gr,) = torch.autograd.grad(ref, x_ref, grad, retain_graph=True)
        assert gx.dtype == in_dtype
        assert rel_err(gx, gr) < 1e-6


@pytest.mark.parametrize("lengths,seqlen,heads,rep", CASES)
def test_unpad_heads_matches_torch(device, lengths, seqlen, heads, rep):
    info = packing.make_unpadded(lengths, seqlen, torch.device(device))
    b, d = len(lengths), 32
    # SDPA's output: [B, H, S, D] (any layout); a BSHD view and a plain contiguous one
    for out in (torch.randn(b, seqlen, heads, d, device=device).transpose(1, 2),
                torch.randn(b, heads, seqlen, d, device=device)):
        x = out.clone().requires_grad_()
        x_ref = out.clone().requires_grad_()
        ours = attn_layout.unpad_heads(x, info)
        ref = packing.unpad_rows(x_ref.transpose(1, 2).reshape(b * seqlen, heads, d), info)
        assert torch.equal(ours, ref)
        g = torch.randn(ref.shape, device=device)
        (gx,) = torch.autograd.grad(ours, x, g)
        (gr,) = torch.autograd.grad(ref, x_ref, g)
        assert torch.equal(gx, gr)


def test_src_is_the_inverse_of_idx():
    info = packing.make_unpadded([3, 1, 2], 3, torch.device("cpu"))
    assert info.src.tolist() == [0, 1, 2, 3, -1, -1, 4, 5, -1]
    assert torch.equal(info.src[info.idx], torch.arange(6))


def _graph_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_layout_qkv_takes_views_of_the_packed_projections(device):
    """step/attention.py's _layout_qkv reads q / k / v [1, H, N, D] as [N, H, D] with views only:
    ``t[0]`` (a select) made its backward write each gradient into a zero-filled full-size tensor,
    a fill and a copy per input (83 + 83 launches, 0.36 ms a step: docs/PERFORMANCE.md, the PyTorch
    ops found with bench/op_origins.py). The
    gradients are the same values either way."""
    from types import SimpleNamespace

    from solution.step import attention

    info = packing.make_unpadded([5, 3], 6, torch.device(device))
    n, d = 8, 64
    module = SimpleNamespace(num_key_value_groups=3)
    base = [torch.randn(1, n, h, d, device=device).transpose(1, 2).requires_grad_() for h in (6, 2, 2)]
    q, k, v = attention._layout_qkv(module, *base, info, torch.float16)
    assert not any("Select" in name for t in (q, k, v) for name in _graph_nodes(t))
    g = [torch.randn(t.shape, device=device).to(t.dtype) for t in (q, k, v)]
    ours = torch.autograd.grad((q, k, v), base, g)
    refs = [x.detach().clone().requires_grad_() for x in base]
    rq, rk, rv = (attn_layout.pad_heads(t[0].transpose(0, 1), info, rep, torch.float16)
                  for t, rep in zip(refs, (1, 3, 3)))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), (rq, rk, rv)))
    theirs = torch.autograd.grad((rq, rk, rv), refs, g)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
