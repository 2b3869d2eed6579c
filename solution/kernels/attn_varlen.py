"""Causal attention over packed rows of different lengths, no padded position: PyTorch's
memory-efficient attention kernels in their variable-length mode (``cu_seqlens``, causal from the
top left within each row). Entry points: ``varlen_forward`` / ``varlen_backward`` (CUDA; q, k, v
[1, N, H, D] contiguous, same heads, fp16 / fp32, a D that ``preflight`` ran), ``rows_reference`` (any device),
``preflight`` and ``schema_refusal`` (asked by step/attention.py before the kernel is used).
What it replaces, why, risks, measurements: docs/kernels/attn_varlen.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from solution.kernels._launches import record

CAUSAL_FROM_TOP_LEFT = 1  # aten's custom_mask_type for SDPA's is_causal


def _forward(q, k, v, cu_seqlens, max_len, scale):
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, CAUSAL_FROM_TOP_LEFT, True, scale=scale)
    return out, lse, seed, offset


def varlen_forward(q, k, v, cu_seqlens, max_len, scale):
    """(out, lse, seed, offset) of the variable-length causal attention; q, k, v [1, N, H, D]
    contiguous, same heads (CUDA)."""
    result = _forward(q, k, v, cu_seqlens, max_len, scale)
    record("efficient_attention_varlen", ours=False)  # PyTorch's kernel, counted for the tests
    return result


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens, seed, offset, max_len, scale):
    """(dq, dk, dv) of ``varlen_forward``."""
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out, cu_seqlens, cu_seqlens, max_len, max_len, lse, 0.0,
        seed, offset, CAUSAL_FROM_TOP_LEFT, False, scale=scale)
    return dq, dk, dv


def preflight(device: torch.device, dtype: torch.dtype, head_dim: int) -> RuntimeError | None:
    """None when ``varlen_forward`` and ``varlen_backward`` run on ``device`` for ``dtype`` heads of
    ``head_dim`` (two rows of 8 and 5 tokens from sin / cos; the generator state is restored);
    else the refusal. CUDA only."""
    n, heads = 13, 2
    try:
        with torch.random.fork_rng(devices=[device]):
            base = torch.arange(n * heads * head_dim, device=device, dtype=torch.float32).view(1, n, heads, head_dim)
            q, k, v = ((f(base * s) * 0.5).to(dtype) for f, s in ((torch.sin, 1.0), (torch.cos, 0.7), (torch.sin, 0.3)))
            cu = torch.tensor([0, 8, n], dtype=torch.int32, device=device)
            scale = head_dim ** -0.5
            out, lse, seed, offset = _forward(q, k, v, cu, 8, scale)
            varlen_backward(torch.ones_like(out), q, k, v, out, lse, cu, seed, offset, 8, scale)
            torch.cuda.synchronize(device)
    except RuntimeError as exc:
        return exc
    return None


def rows_reference(q, k, v, lengths, scale):
    """The same result row by row with F.scaled_dot_product_attention (any device; differentiable),
    q, k, v [1, N, H, D] -> [1, N, H, D]. The boolean causal mask as stock's, not ``is_causal``: on
    the CPU is_causal gives 0 where stock gives NaN for an all-NaN row (tests/test_overflow.py)."""
    outs = []
    for qi, ki, vi in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1)):
        n = qi.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=qi.device).tril()
        o = F.scaled_dot_product_attention(qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2),
                                           attn_mask=causal, scale=scale)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


# The private ATen ops called above, positionally: their reviewed schemas (the same in torch
# 2.10.0-2.13.0). Another schema could change what the positional calls mean: ``schema_refusal``.
ACCEPTED_SCHEMAS = {
    "aten::_efficient_attention_forward": (
        "aten::_efficient_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? bias, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, "
        "float dropout_p, int custom_mask_type, bool compute_log_sumexp=False, *, float? scale=None, "
        "Tensor? seqlen_k=None, int? window_size=None) -> (Tensor output, Tensor logsumexp, "
        "Tensor philox_seed, Tensor philox_offset, SymInt max_seqlen_batch_q, SymInt max_seqlen_batch_k)",
    ),
    "aten::_efficient_attention_backward": (
        "aten::_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, Tensor value, "
        "Tensor? bias, Tensor out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, Tensor logsumexp, float dropout_p, Tensor philox_seed, Tensor philox_offset, "
        "int custom_mask_type, bool bias_requires_grad, *, float? scale=None, int? num_splits_key=None, "
        "int? window_size=None, bool shared_storage_dqdkdv=False) -> (Tensor, Tensor, Tensor, Tensor)",
    ),
}


def op_schemas(name: str) -> tuple[str, ...]:
    """Every schema (overloads included) this torch registers for ``name`` (``aten::...``), also
    on a CPU build; () when unknown."""
    get = getattr(torch._C, "_jit_get_schemas_for_operator", None)
    if get is None:
        return ()
    try:
        return tuple(str(s) for s in get(name))
    except RuntimeError:
        return ()


def schema_refusal() -> RuntimeError | None:
    """None when every private ATen op called here has exactly its ``ACCEPTED_SCHEMAS``; else the
    refusal, naming the op."""
    for name, accepted in ACCEPTED_SCHEMAS.items():
        if op_schemas(name) != accepted:
            return RuntimeError(f"{name}'s schema is not the reviewed one (torch 2.10.0-2.13.0)")
    return None
