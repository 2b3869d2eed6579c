"""Residual add fused with the RMSNorm after it: h = residual + x (rounded to promote(residual, x)),
y = rmsnorm(h) with rmsnorm.py's jit helpers (the same numbers), one kernel each way, no autograd.
Entry points (the decoder-layer node, solution/step/layer.py): ``_launch_forward`` -> (h, y, rstd)
and ``_launch_backward`` -> the gradient buffers of residual / x (one per distinct dtype,
``_grad_dtypes``), with autograd's rounding chain. fp16 / fp32, rows as in rmsnorm_supported.
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
                            gh_row_stride, n_cols, HAS_GRAD_H: tl.constexpr, TWO_OUTPUTS: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """dh = (grad_h + norm_grad(grad_y).to(h.dtype)) rounded to h.dtype, stored in d1's (and d2's)
    dtype: the gradients of residual and x. h, d1, d2 contiguous [n_rows, n_cols]; grad_y, grad_h
    any row stride. HAS_GRAD_H False: dh = the norm's gradient. TWO_OUTPUTS False: d2 unused."""
    rows, rows64, row_mask, cols, col_mask, mask = _row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK)
    h_offs = rows64[:, None] * n_cols + cols[None, :]
    h = tl.load(h_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + rows64[:, None] * gy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    # The norm's contribution reaches h through h.to(float32): autograd rounds it to h's dtype.
    dh = _rms_grad_rows(h, gy, w, rstd, n_cols, h_ptr.dtype.element_ty).to(h_ptr.dtype.element_ty)
    if HAS_GRAD_H:
        gh = tl.load(gh_ptr + rows64[:, None] * gh_row_stride + cols[None, :], mask=mask, other=0.0)
        # autograd's accumulation of h's two gradients, in h's dtype.
        dh = (gh.to(tl.float32) + dh.to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(d1_ptr + h_offs, dh.to(d1_ptr.dtype.element_ty), mask=mask)
    if TWO_OUTPUTS:
        tl.store(d2_ptr + h_offs, dh.to(d2_ptr.dtype.element_ty), mask=mask)


def _grad_dtypes(res_dtype: torch.dtype, x_dtype: torch.dtype, need_res: bool, need_x: bool) -> list[torch.dtype]:
    """Dtypes of the backward's buffers (d1, then d2): one per distinct dtype among residual's and
    x's, for those that need a gradient."""
    dtypes = [res_dtype] if need_res else []
    if need_x and x_dtype not in dtypes:
        dtypes.append(x_dtype)
    return dtypes


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


def _launch_backward(h2, weight, gy2, gh2, rstd, dtypes):
    """The gradient buffers (one per dtype in ``dtypes``, 1 or 2) of residual / x."""
    n_rows, n_cols = h2.shape
    outs = [torch.empty((n_rows, n_cols), dtype=dt, device=h2.device) for dt in dtypes]
    if n_rows > 0:
        block, warps = _row_config(n_cols)
        rows = _rows_per_program(n_rows, block)
        gh_arg = h2 if gh2 is None else gh2  # placeholder of h's dtype, never read when absent
        launch(_add_rmsnorm_bwd_kernel, (cdiv(n_rows, rows),), "_add_rmsnorm_bwd_kernel",
               h2, weight, gy2, gh_arg, rstd, outs[0], outs[-1], n_rows,
               gy2.stride(0), 0 if gh2 is None else gh2.stride(0), n_cols,
               gh2 is not None, len(outs) == 2, rows, block, num_warps=warps)
    return outs


def _launch_dtypes():
    """Every (residual, x, weight) dtype triple the launchers accept."""
    f16, f32 = torch.float16, torch.float32
    return [(r, x, w) for r in (f32, f16) for x in (f16, f32) for w in (f32, f16)]


def sm75_specs():
    """Every GPU launch configuration: at hidden 1536 every dtype triple, forward and backward (x
    grad_h present / absent x which inputs need a gradient); the workload's triple (residual fp32,
    x fp16, weight fp32) at the smallest and largest BLOCK."""
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
        needs = [(True, True), (True, False), (False, True)] if hidden == 1536 else [(True, True)]
        out_sets = {tuple(_grad_dtypes(r_dt, x_dt, nr, nx)) for nr, nx in needs}
        for outs in sorted(out_sets, key=str):
            for has_gh in ((True, False) if hidden == 1536 else (True,)):
                consts = {"HAS_GRAD_H": has_gh, "TWO_OUTPUTS": len(outs) == 2, **shape}
                yield {"name": f"bwd {tag} d={'+'.join(t[dt][1:] for dt in outs)}{'' if has_gh else ' no-gh'}",
                       "fn": _add_rmsnorm_bwd_kernel, "num_warps": warps,
                       "signature": {"h_ptr": t[h_dt], "w_ptr": t[w_dt], "gy_ptr": t[y_dt], "gh_ptr": t[h_dt],
                                     "rstd_ptr": "*fp32", "d1_ptr": t[outs[0]], "d2_ptr": t[outs[-1]],
                                     "n_rows": "i32", "gy_row_stride": "i32", "gh_row_stride": "i32",
                                     "n_cols": "i32", **{k: "constexpr" for k in consts}},
                       "constexprs": consts}
