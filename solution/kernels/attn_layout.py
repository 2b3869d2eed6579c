"""Attention's layout moves for packed rows: pad (+ GQA repeat, + fp16 cast) and unpad (+ group sum).

1. What it replaces. With no work on padding (solution/step/packing.py) the decoder keeps the N real
   tokens of a batch as one packed row, and only attention goes back to the padded layout
   [batch, heads, seqlen, 128] that PyTorch's memory-efficient SDPA needs. Done with torch ops
   (solution/patches/qwen2_unpad.py, ``sdpa_unpadded``) that is, per layer and forward: three
   zero-filled padded buffers and three ``index_copy`` into them (q, k, v), ``repeat_kv``'s copies
   of k and v from 2 to 12 heads, autocast's fp32 -> fp16 casts of q, k and v inside SDPA, then
   the output's ``transpose().reshape()`` copy and an ``index_select`` of the real rows; and in
   backward the mirror images (the casts' backward, the repeat's sum over head groups, gathers
   and zero-filled scatters).

2. Why that was slow. Each of those is a full pass over a [tokens, 12, 128] tensor (6-12 MiB at
   2048 tokens) and a kernel launch, and each launch also costs host time (PyTorch's copy
   kernels' share of the solution's GPU time: docs/kernels/attn_layout.md, section 2).

3. What it does instead. Two kernels, each the other's backward:
   ``pad_rows_kernel``: one program per padded row (b, s): reads the packed row of that token
   (or nothing for a pad position), writes all output heads, head h taken from input head
   h // REP (repeat_kv's order), zeros at pad positions, rounded to the output dtype (fp16 under
   fp16 autocast: the cast SDPA's autocast would make, done in the same pass).
   ``unpad_rows_kernel``: one program per real token: reads its padded row and writes the packed
   row, each output head the fp32 sum of its REP input heads (repeat_kv's backward), rounded once
   to the output dtype.
   The padded tensors are laid out [batch, seqlen, heads, 128] and returned as the
   [batch, heads, seqlen, 128] view, the layout stock's projections give SDPA.

4. Correctness risks. Pure data movement except (a) the cast, which rounds fp32 -> fp16 to nearest
   even like torch's cast, and (b) the backward's group sum: stock sums the REP fp32 gradients
   (autocast's cast backward gives fp32) in fp32; so do we, in another order, so a sum may differ
   in the last fp32 bit (~6e-8 relative). Pad positions of the padded tensors are zeros (SDPA's
   causal mask keeps them away from real queries; their outputs are dropped). Strides: any, with
   unit stride on the last dim and the two padded dims [batch, seqlen] mergeable into one row
   index (true for every contiguous layout); otherwise the launcher makes a contiguous copy.
   Tests: tests/test_attn_layout.py (interpreter and GPU, against the torch ops above).

5. How it was measured: docs/kernels/attn_layout.md, section 5 (kernel benchmark
   bench/kernels/bench_attn_layout.py and two profiled end-to-end runs side by side, against torch's
   index ops): the only layout path for the dtypes it takes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from solution.kernels._launches import launch, pow2_at_least

GPU_NUM_WARPS = 4


@triton.jit(do_not_specialize=["n_rows"])
def pad_rows_kernel(x_ptr, src_ptr, out_ptr, n_rows,
                    x_row_stride, x_head_stride, out_row_stride, out_head_stride,
                    H_IN: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, HP2: tl.constexpr):
    """out[r, h, :] = x[src[r], h // REP, :] (cast to out's dtype), or 0 where src[r] < 0.
    Program r = one padded row; HP2 = next power of two >= H_IN * REP."""
    r = tl.program_id(0)
    src = tl.load(src_ptr + r)
    h = tl.arange(0, HP2)
    d = tl.arange(0, D)
    h_ok = h < H_IN * REP
    # keep = h_ok on a real row, nothing on a pad row, as one block comparison: Triton 3.9's
    # interpreter refuses h_ok & (src >= 0) as a mask (it splats the scalar comparison with
    # src's int64 dtype, so the mask holds integers; 3.6's took them as booleans)
    keep = (h < tl.where(src >= 0, H_IN * REP, 0))[:, None]
    src_safe = tl.maximum(src, 0).to(tl.int64)
    x_off = src_safe * x_row_stride + (h // REP)[:, None] * x_head_stride + d[None, :]
    vals = tl.load(x_ptr + x_off, mask=keep, other=0.0)
    out_off = r.to(tl.int64) * out_row_stride + h[:, None] * out_head_stride + d[None, :]
    tl.store(out_ptr + out_off, vals.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit(do_not_specialize=["n_tokens"])
def unpad_rows_kernel(x_ptr, idx_ptr, out_ptr, n_tokens,
                      x_row_stride, x_head_stride, out_row_stride, out_head_stride,
                      H_OUT: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, HP2: tl.constexpr):
    """out[t, h, :] = sum over g < REP of x[idx[t], h * REP + g, :] (fp32 sum, one rounding).
    Program t = one real token; HP2 = next power of two >= H_OUT."""
    t = tl.program_id(0)
    row = tl.load(idx_ptr + t).to(tl.int64)
    h = tl.arange(0, HP2)
    d = tl.arange(0, D)
    h_ok = (h < H_OUT)[:, None]
    acc = tl.zeros((HP2, D), dtype=tl.float32)
    for g in tl.static_range(REP):
        x_off = row * x_row_stride + (h * REP + g)[:, None] * x_head_stride + d[None, :]
        acc += tl.load(x_ptr + x_off, mask=h_ok, other=0.0).to(tl.float32)
    out_off = t.to(tl.int64) * out_row_stride + h[:, None] * out_head_stride + d[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _rows_heads(x: torch.Tensor):
    """(row stride, head stride) of a [rows, heads, D] view with unit stride on D, else None."""
    if x.dim() != 3 or x.stride(2) != 1:
        return None
    return x.stride(0), x.stride(1)


def _padded_rows_view(x: torch.Tensor):
    """[B, H, S, D] (any layout) -> (tensor, row stride, head stride) where row = b * S + s,
    making a contiguous BSHD copy only when b and s do not merge into one stride."""
    b, h, s, d = x.shape
    if x.stride(3) != 1 or (b > 1 and x.stride(0) != s * x.stride(2)):
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x, x.stride(2), x.stride(1)


def _hp2(n: int) -> int:
    return pow2_at_least(n)


def _launch_pad(rows: torch.Tensor, info, rep: int, out_dtype: torch.dtype) -> torch.Tensor:
    """rows [N, H, D] -> [B, H * rep, S, D] (a view of BSHD memory), zeros at pads."""
    n, h_in, d = rows.shape
    st = _rows_heads(rows)
    if st is None:
        rows = rows.contiguous()
        st = _rows_heads(rows)
    out = torch.empty((info.batch, info.seqlen, h_in * rep, d), dtype=out_dtype, device=rows.device)
    n_rows = info.batch * info.seqlen
    if n_rows:
        launch(pad_rows_kernel, (n_rows,), "pad_rows_kernel",
               rows, info.src, out, n_rows, st[0], st[1], out.stride(1), out.stride(2),
               H_IN=h_in, REP=rep, D=d, HP2=_hp2(h_in * rep), num_warps=GPU_NUM_WARPS)
    return out.transpose(1, 2)


def _launch_unpad(padded: torch.Tensor, info, rep: int, out_dtype: torch.dtype) -> torch.Tensor:
    """padded [B, H * rep, S, D] -> [N, H, D] (group sums over rep heads)."""
    x, row_stride, head_stride = _padded_rows_view(padded)
    h_out, d = x.shape[1] // rep, x.shape[3]
    n = info.idx.numel()
    out = torch.empty((n, h_out, d), dtype=out_dtype, device=x.device)
    if n:
        launch(unpad_rows_kernel, (n,), "unpad_rows_kernel",
               x, info.idx, out, n, row_stride, head_stride, out.stride(0), out.stride(1),
               H_OUT=h_out, REP=rep, D=d, HP2=_hp2(h_out), num_warps=GPU_NUM_WARPS)
    return out


class PadRowsFunction(torch.autograd.Function):
    """Packed rows [N, H, D] -> padded [B, H * rep, S, D] (zeros at pads), optionally cast."""

    @staticmethod
    def forward(ctx, rows, info, rep, out_dtype):
        ctx.info, ctx.rep, ctx.in_dtype = info, rep, rows.dtype
        return _launch_pad(rows, info, rep, out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _launch_unpad(grad, ctx.info, ctx.rep, ctx.in_dtype), None, None, None


class UnpadRowsFunction(torch.autograd.Function):
    """Padded [B, H, S, D] -> the real tokens' rows [N, H, D]."""

    @staticmethod
    def forward(ctx, padded, info):
        ctx.info, ctx.in_dtype = info, padded.dtype
        return _launch_unpad(padded, info, 1, padded.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _launch_pad(grad, ctx.info, 1, ctx.in_dtype), None


def pad_heads(rows: torch.Tensor, info, rep: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """rows [N, H, D] (packed real tokens) -> [B, H * rep, S, D]: head h from input head h // rep
    (repeat_kv), zeros at pad positions, in out_dtype (default rows.dtype). Differentiable."""
    return PadRowsFunction.apply(rows, info, rep, out_dtype or rows.dtype)


def unpad_heads(padded: torch.Tensor, info) -> torch.Tensor:
    """[B, H, S, D] -> [N, H, D], the rows of the real tokens. Differentiable."""
    return UnpadRowsFunction.apply(padded, info)


def supported(t: torch.Tensor) -> bool:
    """fp16/fp32 with a power-of-two head_dim in [16, 256] (one head row is one tl.arange)."""
    d = t.shape[-1]
    return t.dtype in (torch.float16, torch.float32) and 16 <= d <= 256 and d & (d - 1) == 0


def sm75_specs():
    """The workload's launches: head_dim 128, 12 query heads, 2 KV heads repeated 6 times, fp32 in
    (the projections' dtype) -> fp16 out (autocast) and back, plus same-dtype moves."""
    def spec(name, fn, x, out, heads, rep, count_key):
        return {"name": name, "fn": fn, "num_warps": GPU_NUM_WARPS,
                "signature": {"x_ptr": x, ("src_ptr" if fn is pad_rows_kernel else "idx_ptr"): "*i64",
                              "out_ptr": out, count_key: "i32", "x_row_stride": "i32", "x_head_stride": "i32",
                              "out_row_stride": "i32", "out_head_stride": "i32",
                              ("H_IN" if fn is pad_rows_kernel else "H_OUT"): "constexpr", "REP": "constexpr",
                              "D": "constexpr", "HP2": "constexpr"},
                "constexprs": {("H_IN" if fn is pad_rows_kernel else "H_OUT"): heads, "REP": rep, "D": 128,
                               "HP2": _hp2(heads * rep if fn is pad_rows_kernel else heads)}}
    for x, out in (("*fp32", "*fp16"), ("*fp16", "*fp16"), ("*fp32", "*fp32")):
        yield spec(f"pad q {x[1:]}->{out[1:]} H12", pad_rows_kernel, x, out, 12, 1, "n_rows")
        yield spec(f"pad kv {x[1:]}->{out[1:]} H2 x6", pad_rows_kernel, x, out, 2, 6, "n_rows")
    for x, out in (("*fp16", "*fp32"), ("*fp16", "*fp16"), ("*fp32", "*fp32")):
        yield spec(f"unpad q {x[1:]}->{out[1:]} H12", unpad_rows_kernel, x, out, 12, 1, "n_tokens")
        yield spec(f"unpad kv {x[1:]}->{out[1:]} H2 sum6", unpad_rows_kernel, x, out, 2, 6, "n_tokens")
