"""Fused RMSNorm for the decoder-layer node's input norm (stock ``Qwen2RMSNorm.forward``): per row of N,
rstd = rsqrt(mean(x^2) + eps), out = weight * (fp32(x) * rstd).to(x.dtype) in promote(x.dtype, weight.dtype);
one kernel forward (out and an fp32 rstd a row), one for dx (in x's dtype); no weight gradient. Entry points
(solution/step/layer.py): ``_launch_forward(x2, weight, eps)`` -> (out, rstd) and
``_launch_backward_dx(x2, weight, g2, rstd)`` -> dx, for [rows, N] inputs of any row stride and unit column
stride (out, dx contiguous); fp16 / fp32, N <= MAX_HIDDEN (``rmsnorm_supported``). The @triton.jit helpers
``_row_tile``, ``_rms_scale_rows``, ``_rms_grad_rows`` are shared with add_rmsnorm.py, so both compute the
same numbers. What it replaces, why, risks, measurements: docs/kernels/rmsnorm.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.env import interpreter_enabled
from solution.kernels._launches import cdiv, launch, pow2_at_least

# Rows longer than this are left to the stock code (one row must fit in one program's registers).
MAX_HIDDEN = 8192
_SUPPORTED_DTYPES = (torch.float16, torch.float32)


@triton.jit
def _row_tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(rows, rows as int64, row mask, columns, column mask, 2-D mask) of this program's
    [BLOCK_ROWS, BLOCK] tile; BLOCK >= n_cols, a power of two. int64: row * stride may pass 2^31."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    return rows, rows.to(tl.int64), row_mask, cols, col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _rms_scale_rows(x, w, n_cols, eps, X_DTYPE: tl.constexpr):
    """(w * (x * rstd).to(X_DTYPE), rstd), rstd = rsqrt(mean(x^2) + eps) per row, for an fp32 tile
    x [R, BLOCK] (masked lanes 0) and fp32 w [BLOCK]; rounded to X_DTYPE before the multiply, as stock."""
    mean_sq = tl.sum(x * x, axis=1) / n_cols  # masked lanes are 0 and add nothing
    rstd = tl.rsqrt(mean_sq + eps)
    normed = (x * rstd[:, None]).to(X_DTYPE).to(tl.float32)
    return normed * w[None, :], rstd


@triton.jit
def _rms_grad_rows(x, g, w, rstd, n_cols, X_DTYPE: tl.constexpr):
    """fp32 dx = rstd * (dy - xhat * mean(dy * xhat)), xhat = x * rstd, dy = (g * w) rounded to
    X_DTYPE (autograd's gradient of stock's cast). x, g fp32 [R, BLOCK]; w fp32 [BLOCK]; rstd [R]."""
    xhat = x * rstd[:, None]
    dy = (g * w[None, :]).to(X_DTYPE).to(tl.float32)
    mean_dy_xhat = tl.sum(dy * xhat, axis=1) / n_cols
    return (dy - xhat * mean_dy_xhat[:, None]) * rstd[:, None]


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, n_rows, x_row_stride, out_row_stride, n_cols, eps,
                        BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out and the fp32 rstd (``_rms_scale_rows``) of this program's BLOCK_ROWS rows."""
    rows, rows64, row_mask, cols, col_mask, mask = _row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK)
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out, rstd = _rms_scale_rows(x, w, n_cols, eps, x_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_bwd_dx_kernel(x_ptr, w_ptr, g_ptr, rstd_ptr, dx_ptr, n_rows, x_row_stride, g_row_stride,
                           dx_row_stride, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """dx (``_rms_grad_rows``, stored in x.dtype) of this program's BLOCK_ROWS rows."""
    rows, rows64, row_mask, cols, col_mask, mask = _row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK)
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows64[:, None] * g_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    dx = _rms_grad_rows(x, g, w, rstd, n_cols, x_ptr.dtype.element_ty)
    tl.store(dx_ptr + rows64[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _row_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of n_cols elements: ~8-16 fp32 values per thread for one row."""
    block = pow2_at_least(max(n_cols, 1))
    if block <= 1024:
        warps = 4
    elif block <= 4096:
        warps = 8
    else:
        warps = 16
    return block, warps


# Elements one program's tile may hold; 0: one row per program (the GPU). The interpreter pays a
# fixed cost per tl op per program: big tiles there. Tests change both (multi-row tiles).
GPU_TILE_ELEMS = 0
INTERP_TILE_ELEMS = 1 << 16


def _pow2_at_most(n: int) -> int:
    """The largest power of two <= n (1 for n < 1): tl.arange needs power-of-two sizes."""
    return 1 << (max(n, 1).bit_length() - 1)


def _tile_elems() -> int:
    return INTERP_TILE_ELEMS if interpreter_enabled() else GPU_TILE_ELEMS


def _rows_per_program(n_rows: int, block: int) -> int:
    """BLOCK_ROWS: as many rows as fit the tile (at least 1, at most what the input has)."""
    return min(pow2_at_least(max(n_rows, 1)), _pow2_at_most(_tile_elems() // block))


def rmsnorm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the kernels handle these tensors (dtype, shape, size)? Device is checked by the caller."""
    return (x.dtype in _SUPPORTED_DTYPES and weight.dtype in _SUPPORTED_DTYPES
            and weight.dim() == 1 and x.dim() >= 1 and 0 < weight.numel() <= MAX_HIDDEN
            and x.shape[-1] == weight.numel() and x.device == weight.device)


def _launch_forward(x2: torch.Tensor, weight: torch.Tensor, eps: float):
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x2.dtype, weight.dtype), device=x2.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    if n_rows > 0:
        block, warps = _row_config(n_cols)
        rows = _rows_per_program(n_rows, block)
        launch(_rmsnorm_fwd_kernel, (cdiv(n_rows, rows),), "_rmsnorm_fwd_kernel",
               x2, weight, out, rstd, n_rows, x2.stride(0), out.stride(0), n_cols, float(eps), rows, block,
               num_warps=warps)
    return out, rstd


def _launch_backward_dx(x2, weight, g2, rstd):
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    if n_rows > 0:
        block, warps = _row_config(n_cols)
        rows = _rows_per_program(n_rows, block)
        launch(_rmsnorm_bwd_dx_kernel, (cdiv(n_rows, rows),), "_rmsnorm_bwd_dx_kernel",
               x2, weight, g2, rstd, dx, n_rows, x2.stride(0), g2.stride(0), dx.stride(0), n_cols, rows, block,
               num_warps=warps)
    return dx


_TRITON_TYPE = {torch.float16: "*fp16", torch.float32: "*fp32"}


def sm75_specs():
    """Every GPU launch configuration: the workload's (fp32, hidden 1536), the other dtype pairs,
    the smallest and largest row blocks (the interpreter's tiles never run on a GPU)."""
    f32, f16 = torch.float32, torch.float16
    configs = [(f32, f32, 1536), (f16, f32, 1536), (f16, f16, 1536), (f32, f16, 1536),
               (f32, f32, 100), (f32, f32, MAX_HIDDEN)]
    for x_dt, w_dt, hidden in configs:
        block, warps = _row_config(hidden)
        rows = _pow2_at_most(GPU_TILE_ELEMS // block)
        out_dt = torch.promote_types(x_dt, w_dt)
        tag = f"x={_TRITON_TYPE[x_dt][1:]} w={_TRITON_TYPE[w_dt][1:]} BLOCK={block} ROWS={rows} w{warps}"
        constexprs = {"BLOCK_ROWS": rows, "BLOCK": block}
        yield {"name": f"fwd {tag}", "fn": _rmsnorm_fwd_kernel, "num_warps": warps,
               "signature": {"x_ptr": _TRITON_TYPE[x_dt], "w_ptr": _TRITON_TYPE[w_dt],
                             "out_ptr": _TRITON_TYPE[out_dt], "rstd_ptr": "*fp32", "n_rows": "i32",
                             "x_row_stride": "i32", "out_row_stride": "i32", "n_cols": "i32", "eps": "fp32",
                             "BLOCK_ROWS": "constexpr", "BLOCK": "constexpr"},
               "constexprs": constexprs}
        yield {"name": f"bwd dx {tag}", "fn": _rmsnorm_bwd_dx_kernel, "num_warps": warps,
               "signature": {"x_ptr": _TRITON_TYPE[x_dt], "w_ptr": _TRITON_TYPE[w_dt],
                             "g_ptr": _TRITON_TYPE[out_dt], "rstd_ptr": "*fp32", "dx_ptr": _TRITON_TYPE[x_dt],
                             "n_rows": "i32", "x_row_stride": "i32", "g_row_stride": "i32",
                             "dx_row_stride": "i32", "n_cols": "i32",
                             "BLOCK_ROWS": "constexpr", "BLOCK": "constexpr"},
               "constexprs": constexprs}
