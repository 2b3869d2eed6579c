"""Variable-length causal attention on packed rows (solution/kernels/attn_varlen.py) and its use in
sdpa_unpadded (the padded layout only where the variable-length kernel refuses).

The reference is the padded path (the layout kernels + SDPA with is_causal on [batch, heads,
longest row, D]), which tests/test_unpad.py checks against stock. Per real query the keys are
the same; the kernels may sum in another order (other tile counts), so fp16 results agree to a
few fp16 ulps, fp32 ones to 1e-5.
"""
import pytest
import torch

from solution.step import packing
from solution.kernels import _launches, attn_varlen

LENGTHS = [7, 64, 130, 1]


def test_row_offsets_and_packed_layout():
    info = packing.make_unpadded([3, 1, 2], 4, torch.device("cpu"))
    assert info.cu_seqlens.dtype == torch.int32 and info.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert info.arange.tolist() == list(range(6))
    packed = packing.packed_layout(info)
    assert (packed.batch, packed.seqlen, packed.lengths) == (1, 6, (6,))
    assert packed.src.tolist() == packed.idx.tolist() == list(range(6))


def _qkv(n, heads, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_() for _ in range(3)]


def _masked_reference(q, k, v, lengths, scale):
    """fp64 attention over the whole packed row with a block-diagonal causal mask."""
    n = q.shape[1]
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(n)
    allowed = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
    q64, k64, v64 = (t.detach().double().cpu().transpose(1, 2) for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v64).transpose(1, 2)


def test_rows_reference_is_block_causal_attention():
    n, scale = sum(LENGTHS), 16 ** -0.5
    q, k, v = _qkv(n, 3, 16, torch.float32, "cpu")
    info = packing.make_unpadded(LENGTHS, max(LENGTHS), torch.device("cpu"))
    out = attn_varlen.varlen_causal_attention(q, k, v, info, scale)
    torch.testing.assert_close(out.double(), _masked_reference(q, k, v, LENGTHS, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_varlen_kernel_matches_rows_reference(dtype):
    n, heads, d = sum(LENGTHS), 12, 128
    scale = d ** -0.5
    info = packing.make_unpadded(LENGTHS, max(LENGTHS), torch.device("cuda"))
    q, k, v = _qkv(n, heads, d, dtype, "cuda")
    before = _launches.LAUNCHES["efficient_attention_varlen"]
    out = attn_varlen.varlen_causal_attention(q, k, v, info, scale)
    assert _launches.LAUNCHES["efficient_attention_varlen"] == before + 1
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attn_varlen.rows_reference(q, k, v, LENGTHS, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(out.double().cpu(), _masked_reference(q, k, v, LENGTHS, scale),
                               rtol=5e-3 if dtype == torch.float16 else 1e-4, atol=5e-3 if dtype == torch.float16 else 1e-4)


@pytest.mark.gpu
def test_gpu_sdpa_unpadded_varlen_matches_padded_path(monkeypatch):
    """The model's attention shape under fp16 autocast: 12 query heads, 2 KV heads, head_dim 128,
    fp32 projections in (as in the workload), through sdpa_unpadded both ways."""
    from solution.step import attention

    class Attn:  # what sdpa_unpadded reads from the attention module
        num_key_value_groups = 6

    info = packing.make_unpadded(LENGTHS, max(LENGTHS), torch.device("cuda"))
    n = sum(LENGTHS)
    g = torch.Generator().manual_seed(3)
    q0 = torch.randn(1, 12, n, 128, generator=g).cuda()
    k0 = torch.randn(1, 2, n, 128, generator=g).cuda()
    v0 = torch.randn(1, 2, n, 128, generator=g).cuda()
    dout = torch.randn(1, n, 12, 128, generator=g).cuda().half()
    results = {}
    for varlen in ("0", "1"):
        monkeypatch.setattr(attention, "_VARLEN_FAILED", None if varlen == "1" else "padded layout pinned by the test")
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        with torch.autocast("cuda", dtype=torch.float16):
            out, _ = attention.sdpa_unpadded(Attn(), q, k, v, info, dropout=0.0, scaling=128 ** -0.5)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results[varlen] = (out, grads)
    (out_p, grads_p), (out_v, grads_v) = results["0"], results["1"]
    assert out_v.shape == out_p.shape == (1, n, 12, 128) and out_v.dtype == out_p.dtype == torch.float16
    assert all(a.dtype == torch.float32 for a in grads_v)
    # Both paths are fp16 kernels with fp32 accumulation that sum in different orders, so single
    # elements may differ by a few fp16 ulps of intermediate values (measured on the H200: one of
    # 51,712 dq elements 0.0027 apart). The criterion is accuracy against an fp64 reference of
    # the same fp16-rounded inputs: varlen must be no less accurate than the padded path, whose
    # agreement with stock tests/test_unpad.py checks.
    ref, ref_grads = _gqa_reference(q0, k0, v0, dout, LENGTHS, 128 ** -0.5)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), (out_v, *grads_v), (out_p, *grads_p), (ref, *ref_grads)):
        err_v = (a.double().cpu() - r).abs().max().item()
        err_p = (b.double().cpu() - r).abs().max().item()
        scale = r.abs().max().item()
        assert err_v <= 2 * err_p + 1e-3 * scale, (name, err_v, err_p, scale)


def _gqa_reference(q, k, v, dout, lengths, scale):
    """fp64 block-causal attention of fp16-rounded q [1, Hq, N, D], k / v [1, Hkv, N, D] (K/V
    repeated to the query heads) and its gradients for dout [1, N, Hq, D]."""
    q64, k64, v64 = (t.detach().half().double().cpu().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kr, vr = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    n = q.shape[2]
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(n)
    allowed = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
    s = ((q64 @ kr.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(s, -1) @ vr).transpose(1, 2)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double().cpu())
    return out.detach(), grads


def test_varlen_failure_falls_back_to_the_padded_layout_once(device, monkeypatch, capsys):
    """If PyTorch's variable-length kernel refuses this machine (never run on a real T4), the
    attention runs on the padded layout, with one message, and varlen stays off afterwards."""
    from solution.step import attention

    class Attn:
        num_key_value_groups = 1

    def refuse(*args, **kwargs):
        raise RuntimeError("no varlen here")

    monkeypatch.setattr(attention, "_VARLEN_FAILED", None)
    monkeypatch.setattr(attn_varlen, "varlen_causal_attention", refuse)
    # on the device the kernels run on (CPU tensors on a CUDA machine are no input of theirs)
    info = packing.make_unpadded([3, 5], 5, torch.device(device))
    q, k, v = (t.transpose(1, 2) for t in _qkv(8, 2, 16, torch.float32, device))
    _launches.reset()
    out, _ = attention.sdpa_unpadded(Attn(), q, k, v, info, dropout=0.0, scaling=0.25)
    assert out.shape == (1, 8, 2, 16) and _launches.LAUNCHES["pad_rows_kernel"] > 0
    assert "variable-length attention failed (RuntimeError: no varlen here)" in capsys.readouterr().out
    assert not attention.varlen_enabled()
    attention.sdpa_unpadded(Attn(), q, k, v, info, dropout=0.0, scaling=0.25)
    assert capsys.readouterr().out == ""  # said once


def test_varlen_preflight_turns_to_the_padded_layout_once(monkeypatch, capsys):
    """Before a step depends on the variable-length kernel (the decoder-layer node calls it with no
    fallback, and a refusal in a backward could not be caught), a tiny forward and backward runs
    once per device, dtype and head dim (``attention.varlen_works``). A refusal is said once and
    turns attention to the padded layout for good (no node and no graphs with it); without
    CUDA nothing is run (the CPU takes the row-by-row reference)."""
    from solution.step import attention

    monkeypatch.setattr(attention, "_VARLEN_FAILED", None)
    monkeypatch.setattr(attention, "_PREFLIGHT", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch has no answer
    calls = []

    def refuse(device, dtype, head_dim):
        calls.append((device, dtype, head_dim))
        return RuntimeError("no varlen on this GPU")

    monkeypatch.setattr(attn_varlen, "preflight", refuse)
    cuda = torch.device("cuda", 0)
    assert attention.varlen_works(torch.device("cpu"), torch.float16, 128) and calls == []
    assert not attention.varlen_works(cuda, torch.float16, 128)
    assert "variable-length attention failed (RuntimeError: no varlen on this GPU)" in capsys.readouterr().out
    assert not attention.varlen_enabled()
    assert not attention.varlen_works(cuda, torch.float16, 128) and len(calls) == 1
    assert capsys.readouterr().out == ""  # said once
    monkeypatch.setattr(attention, "_VARLEN_FAILED", None)
    monkeypatch.setattr(attn_varlen, "preflight", lambda *a: calls.append(a))  # works: None
    assert attention.varlen_works(cuda, torch.float32, 64) and attention.varlen_works(cuda, torch.float32, 64)
    assert len(calls) == 2  # asked once for that key


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_varlen_preflight_passes_and_draws_nothing(dtype):
    """On this GPU the preflight's forward and backward run (None), and the CUDA generator is where
    it was (the dropout draws that follow stay stock's)."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.get_offset()
    assert attn_varlen.preflight(torch.device("cuda", torch.cuda.current_device()), dtype, 128) is None
    assert gen.get_offset() == before
