"""Variable-length causal attention on packed rows (solution/kernels/attn_varlen.py): the launchers
the decoder-layer node calls (varlen_forward / varlen_backward, wrapped here in a test-only autograd
Function, ``varlen_causal_attention``), and step/attention.py's switch (a refusal turns the packed
step off).

References: the row-by-row SDPA (``rows_reference``) and a block-causal fp64 formula. Per real
query the keys are the same; the kernels may sum in another order (other tile counts), so fp16
results agree to a few fp16 ulps, fp32 ones to 1e-5.

Independent oracle: an fp64 causal attention formula, sequence by sequence with the KV heads
repeated (``_per_sequence_fp64``), against which the production entry's fp16 forward and backward
must be no less accurate than stock's (test_gpu_varlen_attention_against_fp64_at_odd_shapes).
"""
import pytest
import torch
import torch.nn.functional as F

from torch.autograd.function import once_differentiable

from solution.kernels import _launches, attn_varlen
from solution.step import packing


class VarlenCausalAttention(torch.autograd.Function):
    """q, k, v [1, N, H, D] (same heads: KV already repeated), contiguous -> out [1, N, H, D]."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len, scale):
        out, lse, seed, offset = attn_varlen.varlen_forward(q, k, v, cu_seqlens, max_len, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        dq, dk, dv = attn_varlen.varlen_backward(dout, q, k, v, out, lse, cu_seqlens, seed, offset, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_causal_attention(q, k, v, info, scale) -> torch.Tensor:
    """Causal attention of each packed row on its own. q, k, v [1, N, H, D] contiguous, same dtype;
    ``info`` the batch's ``Unpadded`` (row lengths, offsets). Returns [1, N, H, D]."""
    if q.device.type == "cuda":
        return VarlenCausalAttention.apply(q, k, v, info.cu_seqlens, info.max_len, scale)
    return attn_varlen.rows_reference(q, k, v, list(info.lengths), scale)



LENGTHS = [7, 64, 130, 1]


def test_row_offsets():
    info = packing.make_unpadded([3, 1, 2], 4, torch.device("cpu"))
    assert info.cu_seqlens.dtype == torch.int32 and info.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert info.idx.tolist() == [0, 1, 2, 4, 8, 9] and info.positions.tolist() == [0, 1, 2, 0, 0, 1]


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
    out = varlen_causal_attention(q, k, v, info, scale)
    torch.testing.assert_close(out.double(), _masked_reference(q, k, v, LENGTHS, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_varlen_kernel_matches_rows_reference(dtype):
    n, heads, d = sum(LENGTHS), 12, 128
    scale = d ** -0.5
    info = packing.make_unpadded(LENGTHS, max(LENGTHS), torch.device("cuda"))
    q, k, v = _qkv(n, heads, d, dtype, "cuda")
    before = _launches.LAUNCHES["efficient_attention_varlen"]
    out = varlen_causal_attention(q, k, v, info, scale)
    assert _launches.LAUNCHES["efficient_attention_varlen"] == before + 1
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attn_varlen.rows_reference(q, k, v, LENGTHS, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    # GPU only (unverified here), limits kept. fp16 against the row-by-row SDPA: 2e-3 ~ 4 U16
    # (U16 = 2^-11) element-wise. Counted for out: each side one fp16 rounding of an fp32 sum of the
    # same terms in another tile order, so at most one fp16 ulp (2 U16) apart, plus atol for values
    # near 0; the gradients also round P and dS to fp16 inside the kernels (uncounted here: the
    # fp64-anchored criterion is test_gpu_varlen_attention_against_fp64_at_odd_shapes'). fp32: 1e-5.
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)
    # Against fp64 (GPU only, unverified here): fp16 out = sum_j fp16(p_j) v_j (fp32 scores, exp and
    # sums), rounded to fp16. P's rounding errs by at most U16 sum_j p_j |v_j| <= U16 max|v| (4.8 for
    # these inputs), out's by U16 |out|: the error is at most 4.8 U16 + U16 |out| (+ fp32 terms),
    # within atol + rtol |out| = 10 U16 (1 + |out|) for 5e-3 ~ 10 U16. fp32: 1e-4.
    torch.testing.assert_close(out.double().cpu(), _masked_reference(q, k, v, LENGTHS, scale),
                               rtol=5e-3 if dtype == torch.float16 else 1e-4, atol=5e-3 if dtype == torch.float16 else 1e-4)


def test_varlen_preflight_turns_the_packed_step_off_once(monkeypatch, capsys):
    """Before a step depends on the variable-length kernel (the decoder-layer node calls it with no
    fallback, and a refusal in a backward could not be caught), a tiny forward and backward runs
    once per device, dtype and head dim (``attention.varlen_works``). A refusal is said once and
    turns the packed step off for good (stock's forward runs); without CUDA nothing is run (the
    CPU takes the row-by-row reference)."""
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


def _per_sequence_fp64(q, k, v, dout, lengths, scale):
    """Causal attention of each sequence on its own, in float64, with the KV heads repeated to the
    query heads (transformers' repeat_kv), and its gradients for dout: (out, dq, dk, dv).
    q [1, N, Hq, D], k / v [1, N, Hkv, D], dout [1, N, Hq, D]."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    outs = []
    for qi, ki, vi in zip(q64.split(lengths, 1), k64.split(lengths, 1), v64.split(lengths, 1)):
        qi, ki, vi = (t[0].transpose(0, 1) for t in (qi, ki, vi))  # [heads, L, D]
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        n = qi.shape[1]
        s = (qi @ ki.transpose(-1, -2)) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vi).transpose(0, 1))
    out = torch.cat(outs, 0)[None]
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double().cpu())
    return (out.detach(), *grads)


def _stock_per_sequence(q, k, v, lengths, scale):
    """Stock's fp16 attention for one unpadded sequence at a time: repeat_kv, then SDPA with
    is_causal (what transformers' sdpa attention runs on a batch of one unpadded row)."""
    rep = q.shape[2] // k.shape[2]
    outs = []
    for qi, ki, vi in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1)):
        qi, ki, vi = (t.transpose(1, 2) for t in (qi, ki, vi))
        ki, vi = ki.repeat_interleave(rep, 1), vi.repeat_interleave(rep, 1)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(1, 2))
    return torch.cat(outs, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(5, 5), (9, 3), (7, 1)])
def test_gpu_varlen_attention_against_fp64_at_odd_shapes(heads):
    """The production entry (varlen_causal_attention, forward and backward) in fp16 at odd shapes:
    an odd number of heads, GQA (KV heads repeated as the node's qkv_rope does), odd sequence
    lengths and a ragged last sequence (shorter than the longest), against an fp64 per-sequence
    causal attention of the same fp16 inputs. Criterion (as in the test above): each of out, dq,
    dk, dv no worse than K x stock's own fp16 error against fp64 (stock: repeat_kv + SDPA with
    is_causal, sequence by sequence), plus a floor of one fp16 rounding of the largest value.
    K = 2: both are fp16 kernels with fp32 accumulation that sum in different orders (other tiles,
    the backward's key splits), so their worst elements differ by chance, not by method; the
    floor covers a stock error that happens to be near zero."""
    hq, hk = heads
    rep, d = hq // hk, 40  # head dim: a multiple of 8 (the kernel's), not a power of two
    lengths = [17, 1, 33, 9]  # odd lengths; the last shorter than the longest
    n, scale = sum(lengths), d ** -0.5
    g = torch.Generator().manual_seed(hq * 10 + hk)
    q0 = torch.randn(1, n, hq, d, generator=g).half().cuda()
    k0, v0 = (torch.randn(1, n, hk, d, generator=g).half().cuda() for _ in range(2))
    dout = torch.randn(1, n, hq, d, generator=g).half().cuda()
    info = packing.make_unpadded(lengths, max(lengths), torch.device("cuda"))

    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    kr, vr = (t.repeat_interleave(rep, 2).contiguous() for t in (k, v))  # repeat_kv on [1, N, H, D]
    before = _launches.LAUNCHES["efficient_attention_varlen"]
    out = varlen_causal_attention(q, kr, vr, info, scale)
    assert _launches.LAUNCHES["efficient_attention_varlen"] == before + 1
    assert out.shape == (1, n, hq, d) and out.dtype == torch.float16
    ours = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    out_s = _stock_per_sequence(q, k, v, lengths, scale)
    stock = (out_s.detach(), *torch.autograd.grad(out_s, (q, k, v), dout))

    refs = _per_sequence_fp64(q0, k0, v0, dout, lengths, scale)
    for name, a, s, r in zip(("out", "dq", "dk", "dv"), ours, stock, refs):
        assert a.shape == r.shape, name
        err_o = (a.double().cpu() - r).abs().max().item()
        err_s = (s.double().cpu() - r).abs().max().item()
        floor = 2.0 ** -11 * r.abs().max().item()
        assert err_o <= 2 * err_s + floor, (name, err_o, err_s, floor)
