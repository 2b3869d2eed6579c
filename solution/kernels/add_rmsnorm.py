"""Residual add fused with the RMSNorm after it: h = residual + x (rounded to promote(residual, x)),
y = rmsnorm(h) with rmsnorm.py's jit helpers (the same numbers), one kernel each way, no autograd.
Entry points (the decoder-layer node, solution/step/layer.py): ``_launch_forward`` -> (h, y, rstd)
and ``_launch_backward`` -> the gradients of the fp32 residual and the fp16 x (the node's one mode),
with autograd's rounding chain. fp16 / fp32, rows as in rmsnorm_supported.
What it replaces, why, risks, measurements: docs/kernels/add_rmsnorm.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels import rmsnorm as _rms
from solution.kernels._launches import cdiv, launch
from solution.kernels.rmsnorm import _TRITON_TYPE, _rms_grad_rows, _rms_scale_rows, _row_config, _row_tile, _rows_per_program


@triton.jit(do_not_specialize=["n_rows"])
def _add_rmsnorm_fwd_kernel(res_ptr, x_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr, n_rows, res_row_stride, x_row_stride,
                            n_cols, eps, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """h = (residual + x) rounded to h.dtype; y = w * (h * rstd).to(h.dtype); fp32 rstd per row.
    h, y contiguous [n_rows, n_cols]; residual, x any row stride, unit column stride."""
    rows, rows64, row_mask, cols, col_mask, mask = _row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK)
    res = tl.load(res_ptr + rows64[:, None] * res_row_stride + cols[None, :], mask=mask, other=0.0)
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    # torch's add: both operands widened to fp32, added, rounded once to the promoted dtype.
    h = (res.to(tl.float32) + x.to(tl.float32)).to(h_ptr.dtype.element_ty)
    out_offs = rows64[:, None] * n_cols + cols[None, :]
    tl.store(h_ptr + out_offs, h, mask=mask)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y, rstd = _rms_scale_rows(h.to(tl.float32), w, n_cols, eps, h_ptr.dtype.element_ty)
    tl.store(y_ptr + out_offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _add_rmsnorm_bwd_kernel(h_ptr, w_ptr, gy_ptr, gh_ptr, rstd_ptr, d1_ptr, d2_ptr, n_rows, gy_row_stride,
                            gh_row_stride, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """dh = (grad_h + norm_grad(grad_y).to(h.dtype)) rounded to h.dtype, stored in d1's dtype and in
    d2's: the gradients of residual and x. h, d1, d2 contiguous [n_rows, n_cols]; grad_y, grad_h
    any row stride."""
    rows, rows64, row_mask, cols, col_mask, mask = _row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK)
    h_offs = rows64[:, None] * n_cols + cols[None, :]
    h = tl.load(h_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + rows64[:, None] * gy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    # The norm's contribution reaches h through h.to(float32): autograd rounds it to h's dtype.
    dh = _rms_grad_rows(h, gy, w, rstd, n_cols, h_ptr.dtype.element_ty).to(h_ptr.dtype.element_ty)
    gh = tl.load(gh_ptr + rows64[:, None] * gh_row_stride + cols[None, :], mask=mask, other=0.0)
    # autograd's accumulation of h's two gradients, in h's dtype.
    dh = (gh.to(tl.float32) + dh.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(d1_ptr + h_offs, dh.to(d1_ptr.dtype.element_ty), mask=mask)
    tl.store(d2_ptr + h_offs, dh.to(d2_ptr.dtype.element_ty), mask=mask)


def _launch_forward(r2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, eps: float, shape):
    n_rows, n_cols = x2.shape
    h_dtype = torch.promote_types(r2.dtype, x2.dtype)
    h = torch.empty(shape, dtype=h_dtype, device=x2.device)
    y = torch.empty(shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x2.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows > 0:
        block, warps = _row_config(n_cols)
        rows = _rows_per_program(n_rows, block)
        launch(_add_rmsnorm_fwd_kernel, (cdiv(n_rows, rows),), "_add_rmsnorm_fwd_kernel",
               r2, x2, weight, h, y, rstd, n_rows, r2.stride(0), x2.stride(0), n_cols, float(eps), rows, block,
               num_warps=warps)
    return h, y, rstd


def _launch_backward(h2, weight, gy2, gh2, rstd):
    """The node's one mode: from h, grad_y and grad_h (h's gradient from the later residual add, always
    present), the gradients of the fp32 residual and of the fp16 x, as autograd rounds them."""
    n_rows, n_cols = h2.shape
    d_res = torch.empty((n_rows, n_cols), dtype=torch.float32, device=h2.device)
    d_x = torch.empty((n_rows, n_cols), dtype=torch.float16, device=h2.device)
    if n_rows > 0:
        block, warps = _row_config(n_cols)
        rows = _rows_per_program(n_rows, block)
        launch(_add_rmsnorm_bwd_kernel, (cdiv(n_rows, rows),), "_add_rmsnorm_bwd_kernel",
               h2, weight, gy2, gh2, rstd, d_res, d_x, n_rows, gy2.stride(0), gh2.stride(0), n_cols, rows, block,
               num_warps=warps)
    return d_res, d_x


def _launch_dtypes():
    """Every (residual, x, weight) dtype triple the forward launcher accepts."""
    f16, f32 = torch.float16, torch.float32
    return [(r, x, w) for r in (f32, f16) for x in (f16, f32) for w in (f32, f16)]


def sm75_specs():
    """Every GPU launch configuration, 14: the forward for every dtype triple at hidden 1536 (8) and
    the workload's triple (residual fp32, x fp16, weight fp32) at the smallest and largest BLOCK (2);
    the backward (gradients fp32 and fp16: only the triples with residual fp32 and x fp16) for both
    weight dtypes at hidden 1536 (2) and the workload's triple at those two BLOCKs (2)."""
    f16, f32 = torch.float16, torch.float32
    workload = (f32, f16, f32)
    configs = [(t, 1536) for t in _launch_dtypes()] + [(workload, 100), (workload, _rms.MAX_HIDDEN)]
    for (r_dt, x_dt, w_dt), hidden in configs:
        block, warps = _row_config(hidden)
        rows = _rms._pow2_at_most(_rms.GPU_TILE_ELEMS // block)
        h_dt = torch.promote_types(r_dt, x_dt)
        y_dt = torch.promote_types(h_dt, w_dt)
        t = {dt: _TRITON_TYPE[dt] for dt in (f16, f32)}
        tag = f"r={t[r_dt][1:]} x={t[x_dt][1:]} w={t[w_dt][1:]} BLOCK={block} ROWS={rows} w{warps}"
        shape = {"BLOCK_ROWS": rows, "BLOCK": block}
        yield {"name": f"fwd {tag}", "fn": _add_rmsnorm_fwd_kernel, "num_warps": warps,
               "signature": {"res_ptr": t[r_dt], "x_ptr": t[x_dt], "w_ptr": t[w_dt], "h_ptr": t[h_dt],
                             "y_ptr": t[y_dt], "rstd_ptr": "*fp32", "n_rows": "i32", "res_row_stride": "i32",
                             "x_row_stride": "i32", "n_cols": "i32", "eps": "fp32",
                             "BLOCK_ROWS": "constexpr", "BLOCK": "constexpr"},
               "constexprs": shape}
        if (r_dt, x_dt) != (f32, f16):  # the backward's gradients are fp32 and fp16
            continue
        yield {"name": f"bwd {tag}", "fn": _add_rmsnorm_bwd_kernel, "num_warps": warps,
               "signature": {"h_ptr": t[h_dt], "w_ptr": t[w_dt], "gy_ptr": t[y_dt], "gh_ptr": t[h_dt],
                             "rstd_ptr": "*fp32", "d1_ptr": "*fp32", "d2_ptr": "*fp16", "n_rows": "i32",
                             "gy_row_stride": "i32", "gh_row_stride": "i32", "n_cols": "i32",
                             "BLOCK_ROWS": "constexpr", "BLOCK": "constexpr"},
               "constexprs": shape}
