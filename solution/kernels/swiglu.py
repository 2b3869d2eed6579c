"""Fused SwiGLU for the Qwen2 MLP: h = silu(g) * u, forward and backward in one Triton kernel each.

Stock PyTorch (Qwen2MLP: ``act_fn(gate_proj(x)) * up_proj(x)``) runs ``silu`` (one kernel, saves g),
``mul`` (another kernel, saves silu(g) and u) and, in backward, ``mul`` x2 + ``silu_backward``.
Here: one forward kernel (reads g, u; writes h) that saves only g and u, and one backward kernel
that reads dh, g, u, recomputes silu(g) in registers and writes dg and du, optionally in place into
the g / u buffers.

Numerics (the point is to be bitwise identical to stock in fp16):
  stock fp16:  a  = fp16( g / (1 + exp(-g)) )            fp32 math, ``expf`` + IEEE division
               h  = fp16( a * u )                        fp32 product of two fp16 is exact -> 1 rounding
               du = fp16( dh * a )
               dy = fp16( dh * u )                       (the mul's grad for silu's output)
               s  = 1 / (1 + exp(-g))                    fp32
               dg = fp16( (dy * s) * (1 + g * (1 - s)) ) fp32 (nvcc contracts g*(1-s)+1 into an fma)
  We reproduce the same operations in the same order, with both roundings: libdevice ``expf``
  (the CUDA math library's expf, the one torch's kernel calls), ``div_rn`` (IEEE division; Triton's
  plain ``/`` on fp32 is an approximate division), an explicit fma for ``1 + g*(1-s)``.
  Whether a GPU's toolchain produces exactly torch's fp16 silu is checked at first use, exhaustively
  (all 65,536 fp16 inputs, per device and dtype, ``_silu_mode``): if even one differs, the kernels
  switch to a lookup table of torch's own fp16 silu, so the forward output (and du) stay bitwise
  identical to stock by construction. dg is computed in fp32 either way (expected bitwise, checked by
  the GPU test; otherwise within one fp16 rounding). fp32 inputs: same formulas, fp32 roundings.
  In Triton's CPU interpreter libdevice is unavailable: ``tl.exp`` (numpy) replaces it.

FP32_STOCK (``swiglu_fp16_of_fp32`` / ``swiglu_backward_fp16_of_fp32``, used by the fused NF4 MLP in
nf4_mlp.py): g, u, dh stored in fp16 but holding the values of stock's fp32 tensors (fp16 GEMM outputs
that bnb casts back to fp32); the math is the fp32 path above with no intermediate rounding, and h,
dg, du are rounded once to fp16: the casts the next fp16 GEMMs make.

Layout: g, u, dh are 2-D [rows, cols] with any row stride and unit column stride (leading dims are
flattened; anything else is copied to contiguous first). So g and u may be the two halves of one
[tokens, 2 * 8960] tensor (a fused gate/up matmul): ``swiglu(gu[:, :I], gu[:, I:])`` or
``swiglu_packed(gu)``.

In-place backward (``inplace_backward=True``): dg is written into g's buffer and du into u's buffer
(saves two [tokens, 8960] allocations per MLP backward). Safe only when nobody reads g or u after
this backward: true inside Qwen2MLP (g and u are temporaries of the forward). Guards: only inputs
that need a gradient and are not leaves are overwritten, never when g and u overlap in memory, and
the version counters of g and u are bumped afterwards so any other autograd use of them (a second
backward with retain_graph=True, another op that saved them) raises PyTorch's usual "modified by an
inplace operation" error instead of silently reading gradients.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from solution.env import interpreter_enabled
from solution.kernels._device import kernel_device_reason
from solution.kernels._launches import cdiv, launch

# One launch configuration: tiles of 8 rows x 256 columns (2048 elements, 16 per thread with 4
# warps, loaded as 16-byte vectors). 256 divides the MLP width 8960 exactly, so no lane is wasted.
BLOCK_R = 8
BLOCK_C = 256
NUM_WARPS = 4

# "auto": exhaustive check at first use per (device, dtype), compute in registers when it matches
# torch bit for bit, else use a table; "compute" / "table": force one (tests, benchmarks).
SILU_MODE = "auto"
_TABLE_DTYPES = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    """Row indices (int64, so offsets cannot overflow), column indices and the bounds mask of this
    program's [BLOCK_R, BLOCK_C] tile."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None].to(tl.int64), cols[None, :], mask


@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, table_ptr, n_rows, n_cols,
                       stride_g, stride_u, stride_h,
                       SILU_TABLE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP32_STOCK: tl.constexpr):
    """h = round(round(silu(g)) * u) per element, fp32 math, rounding to h's dtype twice like stock
    (silu's output is rounded before the multiply). With SILU_TABLE the rounded silu(g) is read from
    a 65,536-entry table of torch's own silu indexed by g's 16-bit pattern.
    FP32_STOCK: reproduce stock run on fp32 tensors (silu's output kept in fp32), with g / u / h
    stored in fp16: h = fp16(fp32(silu(g)) * u), i.e. stock fp32 followed by the fp16 cast that the
    next fp16 GEMM makes."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    g_raw = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = h_ptr.dtype.element_ty
    if SILU_TABLE:
        bits = g_raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        a = tl.load(table_ptr + bits, mask=mask, other=0.0).to(tl.float32)
    else:
        silu, _ = _silu_f32(g_raw.to(tl.float32), LIBDEVICE_EXP)
        if FP32_STOCK:
            a = silu
        else:
            a = silu.to(out_ty).to(tl.float32)  # stock rounds silu's output to the tensor dtype
    tl.store(h_ptr + rows * stride_h + cols, (a * u).to(out_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, table_ptr, n_rows, n_cols,
                       stride_dh, stride_g, stride_u, stride_dg, stride_du,
                       SILU_TABLE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP32_STOCK: tl.constexpr):
    """From dh, g, u: du = round(dh * round(silu(g))) and
    dg = round(round(dh * u) * s * (1 + g * (1 - s))), s = sigmoid(g), fp32 math in stock's order.
    dg_ptr / du_ptr may equal g_ptr / u_ptr (in place): every element is read before it is written,
    by the same program.
    FP32_STOCK: stock's fp32 backward (no intermediate rounding), dg / du rounded once to their
    fp16 storage: the cast the gate / up GEMMs' backward makes."""
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g_raw = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = dg_ptr.dtype.element_ty
    g = g_raw.to(tl.float32)
    silu, s = _silu_f32(g, LIBDEVICE_EXP)
    if SILU_TABLE:
        bits = g_raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        a = tl.load(table_ptr + bits, mask=mask, other=0.0).to(tl.float32)
    elif FP32_STOCK:
        a = silu
    else:
        a = silu.to(out_ty).to(tl.float32)
    du = (dh * a).to(out_ty)
    if FP32_STOCK:
        dy = dh * u
    else:
        dy = (dh * u).to(out_ty).to(tl.float32)  # stock's mul backward rounds dh * u first
    dg = ((dy * s) * tl.fma(g, 1.0 - s, 1.0)).to(out_ty)
    tl.store(dg_ptr + rows * stride_dg + cols, dg, mask=mask)
    tl.store(du_ptr + rows * stride_du + cols, du, mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., cols] -> 2-D [rows, cols] with unit column stride (a view when possible, else a copy)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.stride(-1) != 1 and t2.shape[-1] > 1:
        t2 = t2.contiguous()
    return t2


# Triton's CPU interpreter pays a fixed cost per tl op per program: there, big tiles (few programs).
INTERP_BLOCK_R, INTERP_BLOCK_C = 256, 256


def _blocks() -> tuple[int, int]:
    return (INTERP_BLOCK_R, INTERP_BLOCK_C) if interpreter_enabled() else (BLOCK_R, BLOCK_C)


def _grid(n_rows: int, n_cols: int):
    block_r, block_c = _blocks()
    return (cdiv(n_rows, block_r), cdiv(n_cols, block_c))


_MODES: dict = {}  # (device, dtype) -> (use_table, table or None)


def _all_16bit_values(dtype: torch.dtype, device) -> torch.Tensor:
    """Every 16-bit pattern as a tensor of ``dtype``, position i holding the pattern i (0..65535)."""
    idx = torch.arange(65536, dtype=torch.int32, device=device)
    return torch.where(idx >= 32768, idx - 65536, idx).to(torch.int16).view(dtype)


def _silu_mode(dtype: torch.dtype, device) -> tuple[bool, torch.Tensor | None]:
    """(use_table, table) for this dtype and device; see the module docstring."""
    if dtype not in _TABLE_DTYPES or SILU_MODE == "compute":
        return False, None
    key = (torch.device(device), dtype)
    if SILU_MODE == "auto" and key in _MODES:
        return _MODES[key]
    x = _all_16bit_values(dtype, device)
    ref = torch.nn.functional.silu(x)
    mode = (True, ref)
    if SILU_MODE == "auto":
        ours = torch.empty_like(x)
        with warnings.catch_warnings():  # the interpreter's numpy warns on inf / NaN inputs
            warnings.simplefilter("ignore", RuntimeWarning)
            _launch_fwd(x.view(1, -1), torch.ones_like(x).view(1, -1), ours.view(1, -1), False, None)
        same = (ours.view(torch.int16) == ref.view(torch.int16)) | (torch.isnan(ours) & torch.isnan(ref))
        mode = (False, None) if bool(same.all()) else (True, ref)
        _MODES[key] = mode
    return mode


def silu_mode_name(dtype: torch.dtype, device) -> str:
    """'table' or 'compute': which way the kernels get fp16 silu(g) on this device (for reports)."""
    return "table" if _silu_mode(dtype, device)[0] else "compute"


def _launch_fwd(g2, u2, h2, use_table: bool, table, fp32_stock: bool = False) -> None:
    n_rows, n_cols = g2.shape
    block_r, block_c = _blocks()
    launch(_swiglu_fwd_kernel, _grid(n_rows, n_cols), "swiglu_fwd",
           g2, u2, h2, table if use_table else g2, n_rows, n_cols, g2.stride(0), u2.stride(0), h2.stride(0),
           use_table, not interpreter_enabled(), block_r, block_c, fp32_stock, num_warps=NUM_WARPS)


def _launch_bwd(dh2, g2, u2, dg2, du2, use_table: bool, table, fp32_stock: bool = False) -> None:
    n_rows, n_cols = g2.shape
    block_r, block_c = _blocks()
    launch(_swiglu_bwd_kernel, _grid(n_rows, n_cols), "swiglu_bwd",
           dh2, g2, u2, dg2, du2, table if use_table else g2, n_rows,
           n_cols, dh2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
           use_table, not interpreter_enabled(), block_r, block_c, fp32_stock, num_warps=NUM_WARPS)


def swiglu_fp16_of_fp32(g16: torch.Tensor, u16: torch.Tensor) -> torch.Tensor:
    """fp16(silu(fp32(g)) * fp32(u)) for 2-D fp16 g, u (unit column stride): what stock computes
    when the gate / up outputs are fp32 tensors holding fp16 values (bnb casts its fp16 GEMM output
    back to the fp32 input's dtype), followed by the down projection's fp16 cast. No autograd."""
    h = torch.empty(g16.shape, dtype=torch.float16, device=g16.device)
    if h.numel():
        _launch_fwd(g16, u16, h, False, None, fp32_stock=True)
    return h


def swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg_out, du_out) -> None:
    """The matching backward (2-D fp16 tensors): dg = fp16(stock fp32 dg), du = fp16(stock fp32
    du), given dh (an fp16 GEMM output, exact in fp32). dg_out / du_out may be g16 / u16."""
    if g16.numel():
        _launch_bwd(dh16, g16, u16, dg_out, du_out, False, None, fp32_stock=True)


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """h = silu(g) * u without autograd; a new contiguous tensor of g's shape and dtype."""
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if h.numel():
        _launch_fwd(_rows(g), _rows(u), h.view(-1, h.shape[-1]), *_silu_mode(g.dtype, g.device))
    return h


def _swiglu_backward(dh, g, u, dg_out, du_out) -> None:
    """Writes dg, du (2-D [rows, cols] views with unit column stride) from dh, g, u (2-D too)."""
    if g.numel():
        _launch_bwd(dh, g, u, dg_out, du_out, *_silu_mode(g.dtype, g.device))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Could a and b share an element? Exact for two 2-D row-strided tensors with the same row
    stride (e.g. the gate and up halves of one [tokens, 2 * I] tensor: disjoint), conservative
    (overlapping address ranges) otherwise."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a2, b2 = _rows(a), _rows(b)
    if a2.data_ptr() != a.data_ptr() or b2.data_ptr() != b.data_ptr():
        return True  # _rows copied: be conservative
    rows, cols = a2.shape
    stride = a2.stride(0)
    if b2.shape == a2.shape and b2.stride(0) == stride and (rows == 1 or stride >= cols):
        shift = (b2.storage_offset() - a2.storage_offset()) % stride if rows > 1 else \
            b2.storage_offset() - a2.storage_offset()
        if rows > 1:
            return not (shift >= cols and shift + cols <= stride)
        return abs(shift) < cols

    def span(t):
        extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        return t.storage_offset(), t.storage_offset() + extent
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _bump_version(*tensors: torch.Tensor) -> None:
    """Mark tensors as modified in place, so autograd refuses to reuse them: each tensor's version
    counter rises by one (torch.autograd.graph.increment_version, given the tensor itself)."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, inplace_backward):
        h = swiglu_forward(g, u)
        ctx.save_for_backward(g, u)
        # Overwrite g / u in backward only if asked, both are non-leaves and they do not overlap.
        ctx.overwrite = (inplace_backward and g.grad_fn is not None and u.grad_fn is not None
                         and not _overlap(g, u))
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2, u2, dh2 = _rows(g), _rows(u), _rows(dh)
        if ctx.overwrite and need_g and need_u:
            dg2, du2 = g2, u2  # in place (see the module docstring for why this is safe here)
        else:
            dg2, du2 = torch.empty_like(g2, memory_format=torch.contiguous_format), \
                torch.empty_like(u2, memory_format=torch.contiguous_format)
        _swiglu_backward(dh2, g2, u2, dg2, du2)
        _bump_version(*[t for t, buf in ((g, dg2), (u, du2)) if buf.data_ptr() == t.data_ptr()])
        return (dg2.reshape(g.shape) if need_g else None), (du2.reshape(u.shape) if need_u else None), None


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, inplace_backward):
        half = gu.shape[-1] // 2
        h = swiglu_forward(gu[..., :half], gu[..., half:])
        ctx.save_for_backward(gu)
        ctx.overwrite = inplace_backward and gu.grad_fn is not None
        return h

    @staticmethod
    def backward(ctx, dh):
        (gu,) = ctx.saved_tensors
        half = gu.shape[-1] // 2
        gu2 = _rows(gu)
        d = gu2 if ctx.overwrite else torch.empty(gu2.shape, dtype=gu.dtype, device=gu.device)
        _swiglu_backward(_rows(dh), gu2[:, :half], gu2[:, half:], d[:, :half], d[:, half:])
        if d.data_ptr() == gu.data_ptr():
            _bump_version(gu)
        return d.reshape(gu.shape), None


def unsupported_reason(g: torch.Tensor, u: torch.Tensor) -> str | None:
    """None when the kernels handle (g, u) here, else why the stock expression must be used."""
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        return "g and u differ in shape, dtype or device"
    if g.dtype not in _SUPPORTED_DTYPES:
        return f"dtype {g.dtype} is not supported"
    reason = kernel_device_reason(g.device)
    if reason is not None:
        return reason
    # on top of the device rule: bf16 arithmetic in hardware (sm_80+; the T4 emulates it)
    if g.dtype == torch.bfloat16 and g.is_cuda and torch.cuda.get_device_capability(g.device) < (8, 0):
        return "bf16 needs sm_80+"
    return None


def swiglu(g: torch.Tensor, u: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """silu(g) * u, differentiable, same shape and dtype as g (fp16 / fp32; bf16 on sm_80+).

    Forward bitwise identical to ``F.silu(g) * u`` for fp16 / bf16 (guaranteed, see the module
    docstring); fp32 uses the same formula (expected identical, not enforced). Unsupported inputs
    (mixed dtypes, other devices...) run that stock expression instead. ``inplace_backward=True``
    lets the backward write dg / du into g / u's memory (see module docstring for the conditions).
    """
    if unsupported_reason(g, u) is not None:
        return torch.nn.functional.silu(g) * u
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SwiGLU.apply(g, u, inplace_backward)
    return swiglu_forward(g, u)


def swiglu_packed(gu: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """silu(gate) * up where gu = [..., 2 * I] holds gate in its first half and up in its second
    (a fused gate/up projection). Returns [..., I]; the gradient is one [..., 2 * I] tensor (no
    concatenation), optionally written in place into gu."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu_packed needs an even last dimension, got {tuple(gu.shape)}")
    half = gu.shape[-1] // 2
    g, u = gu[..., :half], gu[..., half:]
    if unsupported_reason(g, u) is not None:
        return torch.nn.functional.silu(g) * u
    if torch.is_grad_enabled() and gu.requires_grad:
        return _SwiGLUPacked.apply(gu, inplace_backward)
    return swiglu_forward(g, u)


# ----------------------------------------------------------------------------------------------
# For python -m solution.sm75_check: every launch configuration used on a T4.
# ----------------------------------------------------------------------------------------------

def sm75_specs():
    for dt, table, fp32_stock in (("fp16", False, False), ("fp16", True, False), ("fp32", False, False),
                                  ("fp16", False, True)):
        consts = {"SILU_TABLE": table, "LIBDEVICE_EXP": True, "BLOCK_R": BLOCK_R, "BLOCK_C": BLOCK_C,
                  "FP32_STOCK": fp32_stock}
        tag = (f"{dt}{' table' if table else ''}{' fp32-stock' if fp32_stock else ''} "
               f"{BLOCK_R}x{BLOCK_C} w{NUM_WARPS}")
        yield {"name": f"swiglu_fwd {tag}", "fn": _swiglu_fwd_kernel, "num_warps": NUM_WARPS,
               "signature": {"g_ptr": f"*{dt}", "u_ptr": f"*{dt}", "h_ptr": f"*{dt}",
                             "table_ptr": f"*{dt}", "n_rows": "i32", "n_cols": "i32",
                             "stride_g": "i32", "stride_u": "i32", "stride_h": "i32",
                             **{k: "constexpr" for k in consts}},
               "constexprs": consts}
        yield {"name": f"swiglu_bwd {tag}", "fn": _swiglu_bwd_kernel, "num_warps": NUM_WARPS,
               "signature": {"dh_ptr": f"*{dt}", "g_ptr": f"*{dt}", "u_ptr": f"*{dt}",
                             "dg_ptr": f"*{dt}", "du_ptr": f"*{dt}", "table_ptr": f"*{dt}",
                             "n_rows": "i32", "n_cols": "i32", "stride_dh": "i32",
                             "stride_g": "i32", "stride_u": "i32", "stride_dg": "i32",
                             "stride_du": "i32", **{k: "constexpr" for k in consts}},
               "constexprs": consts}
