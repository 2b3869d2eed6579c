"""SwiGLU of the fused NF4 MLP, no autograd: ``swiglu_fp16_of_fp32(g, u)`` -> h = fp16(silu(fp32 g)
* fp32 u); ``swiglu_backward_fp16_of_fp32`` -> dg, du = fp16(stock's fp32 gradients), may write in
place over g / u. 2-D fp16 tensors, unit column stride; the fp32 math in torch's operation order.
What it replaces, why, risks, measurements: docs/kernels/swiglu.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from solution.env import interpreter_enabled
from solution.kernels._launches import cdiv, launch

# Tiles of 8 x 256 (16 elements a thread, 16-byte vectors); 256 divides the MLP width 8960.
BLOCK_R = 8
BLOCK_C = 256
NUM_WARPS = 4
# Triton's CPU interpreter pays a fixed cost per tl op per program: there, big tiles (few programs).
INTERP_BLOCK_R, INTERP_BLOCK_C = 256, 256


@triton.jit
def _silu_f32(g, LIBDEVICE_EXP: tl.constexpr):
    """silu(g) = g / (1 + exp(-g)) and the sigmoid 1 / (1 + exp(-g)), fp32, torch's operation order."""
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)  # the CUDA math library's expf, as in torch's silu kernel
    else:
        e = tl.exp(-g)  # CPU interpreter: libdevice is not available there
    denom = 1.0 + e
    silu = tl.math.div_rn(g, denom)  # IEEE division (plain '/' is approximate on fp32)
    sigmoid = tl.math.div_rn(1.0, denom)
    return silu, sigmoid


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(int64 rows, columns, bounds mask) of this program's [BLOCK_R, BLOCK_C] tile."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None].to(tl.int64), cols[None, :], mask


@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, n_rows, n_cols, stride_g, stride_u, stride_h,
                       LIBDEVICE_EXP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """h = fp16(fp32 silu(g) * u): stock's fp32 math, rounded once."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    silu, _ = _silu_f32(g, LIBDEVICE_EXP)
    tl.store(h_ptr + rows * stride_h + cols, (silu * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_rows, n_cols,
                       stride_dh, stride_g, stride_u, stride_dg, stride_du,
                       LIBDEVICE_EXP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """du = dh * silu(g), dg = (dh * u) * s * (1 + g * (1 - s)), s = sigmoid(g), fp32, each rounded once;
    dg_ptr / du_ptr may be g_ptr / u_ptr (each element is read before written, by one program)."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = dg_ptr.dtype.element_ty
    silu, s = _silu_f32(g, LIBDEVICE_EXP)
    du = (dh * silu).to(out_ty)
    dg = ((dh * u * s) * tl.fma(g, 1.0 - s, 1.0)).to(out_ty)
    tl.store(dg_ptr + rows * stride_dg + cols, dg, mask=mask)
    tl.store(du_ptr + rows * stride_du + cols, du, mask=mask)


def _grid(n_rows: int, n_cols: int):
    block_r, block_c = (INTERP_BLOCK_R, INTERP_BLOCK_C) if interpreter_enabled() else (BLOCK_R, BLOCK_C)
    return (cdiv(n_rows, block_r), cdiv(n_cols, block_c)), block_r, block_c


def swiglu_fp16_of_fp32(g16: torch.Tensor, u16: torch.Tensor) -> torch.Tensor:
    """fp16(silu(fp32(g)) * fp32(u)) for 2-D fp16 g, u (unit column stride); a new fp16 tensor."""
    h = torch.empty(g16.shape, dtype=torch.float16, device=g16.device)
    if h.numel():
        n_rows, n_cols = g16.shape
        grid, block_r, block_c = _grid(n_rows, n_cols)
        launch(_swiglu_fwd_kernel, grid, "swiglu_fwd", g16, u16, h, n_rows, n_cols, g16.stride(0), u16.stride(0),
               h.stride(0), not interpreter_enabled(), block_r, block_c, num_warps=NUM_WARPS)
    return h


def swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg_out, du_out) -> None:
    """dg_out, du_out = fp16(stock's fp32 dg, du) from fp16 dh, g, u (2-D, unit column stride);
    dg_out / du_out may be g16 / u16."""
    if g16.numel():
        n_rows, n_cols = g16.shape
        grid, block_r, block_c = _grid(n_rows, n_cols)
        launch(_swiglu_bwd_kernel, grid, "swiglu_bwd", dh16, g16, u16, dg_out, du_out, n_rows, n_cols,
               dh16.stride(0), g16.stride(0), u16.stride(0), dg_out.stride(0), du_out.stride(0),
               not interpreter_enabled(), block_r, block_c, num_warps=NUM_WARPS)


# For python -m solution.sm75_check: the launch configuration used on a T4.
def sm75_specs():
    consts = {"LIBDEVICE_EXP": True, "BLOCK_R": BLOCK_R, "BLOCK_C": BLOCK_C}
    tag = f"fp16 {BLOCK_R}x{BLOCK_C} w{NUM_WARPS}"
    yield {"name": f"swiglu_fwd {tag}", "fn": _swiglu_fwd_kernel, "num_warps": NUM_WARPS,
           "signature": {"g_ptr": "*fp16", "u_ptr": "*fp16", "h_ptr": "*fp16", "n_rows": "i32", "n_cols": "i32",
                         "stride_g": "i32", "stride_u": "i32", "stride_h": "i32", **{k: "constexpr" for k in consts}},
           "constexprs": consts}
    yield {"name": f"swiglu_bwd {tag}", "fn": _swiglu_bwd_kernel, "num_warps": NUM_WARPS,
           "signature": {"dh_ptr": "*fp16", "g_ptr": "*fp16", "u_ptr": "*fp16", "dg_ptr": "*fp16", "du_ptr": "*fp16",
                         "n_rows": "i32", "n_cols": "i32", "stride_dh": "i32", "stride_g": "i32", "stride_u": "i32",
                         "stride_dg": "i32", "stride_du": "i32", **{k: "constexpr" for k in consts}},
           "constexprs": consts}
