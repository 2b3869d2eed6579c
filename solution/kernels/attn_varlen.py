"""Causal attention over packed rows of different lengths, with no padded positions at all.

1. What it replaces. Stock's attention on the padded batch: q / k / v as [batch, heads, longest
   row, 128] and PyTorch's memory-efficient SDPA with the causal padding mask.

2. Why that is slow. The attention kernel does its causal work on every padded position too: a
   row of length L in a batch padded to S costs ~S^2 / 2 instead of ~L^2 / 2 (and so does the
   backward). On this workload's data that is ~52% of the attention work: the mean of
   4 x max(L)^2 against the sum of L^2, over random batches of 4 of the 256 examples' token
   lengths. Computed, not measured.

3. What it does instead. The same PyTorch memory-efficient attention kernels in their
   variable-length mode (``aten::_efficient_attention_forward`` / ``_backward`` with
   ``cu_seqlens``): the packed rows [1, N, heads, 128] and the row offsets, causal from the top
   left within each row (SDPA's ``is_causal``), one launch for all rows. Grouped-query attention
   is not supported by that mode: the KV heads are repeated 2 -> 12 by kernels/qkv_rope.py, in the
   launch that also sums the LoRA outputs and applies RoPE.
   This is PyTorch's own kernel (not a kernel library). It is the default rather than a Triton
   attention because Triton >= 3.3 runs ``tl.dot`` on a T4 without tensor cores (field notes); our
   own Triton attention was built and measured against it and lost (docs/PERFORMANCE.md, "Code
   removed because it lost its measurement").

4. Correctness risks. Per real query the set of keys is the padded path's (causal within the row);
   what can differ is the order of the fp32 sums inside the kernel (other tile counts for other
   lengths), so results agree to fp16 rounding, not bit for bit: tested against stock
   (tests/test_unpad.py, tests/test_attn_varlen.py, GPU). Attention dropout (Qwen2's is 0.0) keeps
   stock's forward. Without CUDA (the CPU interpreter) there is no variable-length kernel:
   ``rows_reference`` runs SDPA row by row instead, so that the wiring (row offsets, gradients) is
   tested on the CPU too.
   The backward lets the kernel choose how to split the key dimension (as stock SDPA does), which
   may sum with atomics: not bitwise reproducible run to run (neither is the padded path's).

5. How it was measured: docs/kernels/attn_varlen.md, section 5 (profiled whole runs against the
   padded path: GPU time, attention kernels, peak memory, loss). GPU tests: tests/test_attn_varlen.py,
   tests/test_unpad.py. Where the kernel refuses (step/attention.py, ``varlen_works``), the packed
   step is off and stock's forward runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from solution.kernels._launches import record

CAUSAL_FROM_TOP_LEFT = 1  # aten's custom_mask_type for SDPA's is_causal


def supported(q: torch.Tensor) -> bool:
    """Inputs the variable-length kernel takes: fp16 (the T4's attention dtype) or fp32, head dim
    <= 128 and a multiple of 8 (its aligned kernels). The device decides in
    ``varlen_causal_attention`` (CUDA: the kernel; otherwise the row-by-row reference)."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.float32) and d <= 128 and d % 8 == 0


def _forward(q, k, v, cu_seqlens, max_len, scale):
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, CAUSAL_FROM_TOP_LEFT, True, scale=scale)
    return out, lse, seed, offset


def varlen_forward(q, k, v, cu_seqlens, max_len, scale):
    """(out, lse, seed, offset): PyTorch's memory-efficient attention in its variable-length causal
    mode (CUDA). q, k, v [1, N, H, D] contiguous, same heads."""
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
    """None when ``varlen_forward`` and ``varlen_backward`` run on ``device`` for heads of
    ``head_dim`` in ``dtype`` (two packed rows of 8 and 5 tokens, 2 heads, values from sin / cos:
    nothing random is drawn, and the generator state is restored around the call anyway); else
    the refusal. Run once per device, dtype and head dim by step/attention.py before
    a step depends on the kernel (never on the CPU)."""
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
    """The same result row by row with F.scaled_dot_product_attention (any device; differentiable).
    q, k, v [1, N, H, D] -> [1, N, H, D].
    With the boolean causal mask, as stock passes for a right-padded batch, not ``is_causal``: on
    the CPU, SDPA's is_causal kernel returns 0 for a query whose scores are all NaN where the masked
    call (stock's) returns NaN (finite results are the same bits; tests/test_overflow.py)."""
    outs = []
    for qi, ki, vi in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1)):
        n = qi.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=qi.device).tril()
        o = F.scaled_dot_product_attention(qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2),
                                           attn_mask=causal, scale=scale)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


# The private ATen ops called above, positionally: the schemas they were reviewed with (one each,
# the same in torch 2.10.0, 2.11.0, 2.12.0, 2.12.1 and 2.13.0: native_functions.yaml of each
# release). Another schema (an argument moved, renamed or added before those we pass, another
# overload) could give the positional calls another meaning: ``schema_refusal`` then refuses the
# kernel and the packed step is off (step/attention.py: stock's forward runs).
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
    """Every schema (overloads included) this torch registers for the operator ``name``
    (``aten::...``); read on any build, also a CPU one for CUDA-only ops. () when unknown."""
    get = getattr(torch._C, "_jit_get_schemas_for_operator", None)
    if get is None:
        return ()
    try:
        return tuple(str(s) for s in get(name))
    except RuntimeError:
        return ()


def schema_refusal() -> RuntimeError | None:
    """None when every private ATen op ``varlen_forward`` / ``varlen_backward`` call has exactly
    its reviewed schemas (``ACCEPTED_SCHEMAS``); else the refusal, naming the op. Asked by
    step/attention.py before the first use of the kernel (with ``preflight``)."""
    for name, accepted in ACCEPTED_SCHEMAS.items():
        if op_schemas(name) != accepted:
            return RuntimeError(f"{name}'s schema is not the reviewed one (torch 2.10.0-2.13.0)")
    return None
