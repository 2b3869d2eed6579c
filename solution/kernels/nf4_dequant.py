"""NF4 dequantization: a bitsandbytes 4-bit NormalFloat weight (double quantization included) to
fp16 in one Triton kernel, bit for bit ``bitsandbytes.functional.dequantize_4bit``: value =
fp16(NF4[code] * scale[block]), scale = fp32(fp32(code2[q] * absmax2) + offset) (no FMA:
``enable_fp_fusion=False``); element 2i is the high nibble of byte i. Entry points: ``DequantPlan``
(one per weight; ``launch`` can add the layers' fp16 casts, ``nf4_dequant_cast_kernel``),
``dequantize_nf4`` (one-off), ``unsupported_reason``.
What it replaces, why, risks, measurements: docs/kernels/nf4_dequant.md.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from solution.kernels._blocks import load_block, store_block
from solution.kernels._launches import cdiv, launch

KERNEL_NAME = "nf4_dequant"

# The 16 NF4 levels, exactly bitsandbytes' get_4bit_type("nf4") (tests check equality).
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

# GPU: 64 blocks of 64 elements per program (2 KB in, 8 KB of fp16 out), 4 warps.
GPU_BLOCKS_PER_PROGRAM = 64
GPU_NUM_WARPS = 4
# In the CPU interpreter each program costs Python overhead, so fewer, larger programs.
INTERPRETER_BLOCKS_PER_PROGRAM = 1024


@triton.jit
def _to_fp16(p, ROUND_BF16: tl.constexpr):
    """Round the fp32 products to fp16 (round-to-nearest-even), optionally through bf16."""
    if ROUND_BF16:
        # fp32 -> bf16 round-to-nearest-even with integer ops (sm_75 has no bf16), then the exact
        # bf16 -> fp16 cast. A NaN is kept as it is: the add would carry its payload into the sign bit.
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        p = tl.where(p != p, p, bits.to(tl.float32, bitcast=True))
    return p.to(tl.float16)


@triton.jit
def _dequant_blocks(
    pid, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, lut_ptr, out_ptr,
    n_elements, n_bytes, n_blocks,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BS: tl.constexpr,
    NB: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """out[e] = fp16(NF4[code(e)] * scale(e // BLOCKSIZE)) for the NB blocks of program ``pid``;
    scale(b) = absmax[b], or (NESTED) fp32(fp32(code2[absmax[b]] * absmax2[b // NESTED_BS]) + offset)."""
    HALF: tl.constexpr = BLOCKSIZE // 2  # packed bytes per block
    blk = pid * NB + tl.arange(0, NB)  # [NB] block indices of this program
    blk_ok = blk < n_blocks

    # 1. per-block scale, rebuilt in registers
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=blk_ok, other=0).to(tl.int32)
        c2 = tl.load(code2_ptr + q)  # gather from the 1 KB second-level map (L1 resident)
        a2 = tl.load(absmax2_ptr + blk // NESTED_BS, mask=blk_ok, other=0.0)
        scale = c2 * a2               # rounded to fp32 here (no FMA: enable_fp_fusion=False)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + blk, mask=blk_ok, other=0.0).to(tl.float32)
    scale = scale[:, None]

    # 2. packed bytes of the NB blocks: [NB, HALF], contiguous -> wide vector loads
    byte_idx = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]
    packed = tl.load(packed_ptr + byte_idx, mask=byte_idx < n_bytes, other=0).to(tl.int32)
    # one load per element from the 64-byte table (one L1 line): measured faster on the H200 than
    # a select tree, whatever the layout conversions Triton adds around the gather
    lvl_hi = tl.load(lut_ptr + (packed >> 4))
    lvl_lo = tl.load(lut_ptr + (packed & 15))
    hi = _to_fp16(lvl_hi * scale, ROUND_BF16)  # element 2j: high nibble of byte j
    lo = _to_fp16(lvl_lo * scale, ROUND_BF16)  # element 2j+1: low nibble

    # 3. interleave hi/lo and store [NB, BLOCKSIZE] fp16 (16-byte stores)
    vals = tl.reshape(tl.join(hi, lo), [NB, BLOCKSIZE])
    out_idx = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(out_ptr + out_idx, vals, mask=out_idx < n_elements)


@triton.jit
def _cast_elems(offs, mask, a_ptr, a16_ptr, b_ptr, b16_ptr, scaling,
                CAST_A: tl.constexpr, CAST_B: tl.constexpr, MASKED: tl.constexpr):
    a_raw = load_block(a_ptr + offs, mask, 0.0, MASKED)
    a16 = a_raw.to(tl.float16)
    if CAST_A:
        store_block(a16_ptr + offs, a16, mask, MASKED)
    if CAST_B == 1:
        b16 = load_block(b_ptr + offs, mask, 0.0, MASKED).to(tl.float16)
        store_block(b16_ptr + offs, b16, mask, MASKED)
    if CAST_B == 3:
        keep = load_block(b_ptr + offs, mask, 0, MASKED).to(tl.float32)
        store_block(b16_ptr + offs, ((a_raw.to(tl.float32) * keep) * scaling).to(tl.float16), mask, MASKED)


@triton.jit
def _cast_block(pid, a_ptr, a16_ptr, b_ptr, b16_ptr, n, scaling,
                CAST_A: tl.constexpr, CAST_B: tl.constexpr, BLOCK: tl.constexpr):
    """Elements [pid * BLOCK, (pid + 1) * BLOCK) of one or two same-sized contiguous tensors, cast
    as torch's ``.to(torch.float16)``: CAST_A: a16 = fp16(a); CAST_B 1: b16 = fp16(b); 3: b a bool
    dropout mask, b16 = fp16((fp32(a) * mask) * scaling) (native_dropout's value). Whole blocks
    unmasked, the last one masked (kernels/_blocks.py)."""
    start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    if start + BLOCK <= n:
        _cast_elems(offs, mask, a_ptr, a16_ptr, b_ptr, b16_ptr, scaling, CAST_A, CAST_B, False)
    else:
        _cast_elems(offs, mask, a_ptr, a16_ptr, b_ptr, b16_ptr, scaling, CAST_A, CAST_B, True)


@triton.jit
def nf4_dequant_kernel(
    packed_ptr,    # *u8   packed codes, (n_elements + 1) // 2 bytes
    absmax_ptr,    # *u8 (NESTED) or *fp32: one entry per block of BLOCKSIZE elements
    code2_ptr,     # *fp32 [256] second-level code map (NESTED only)
    absmax2_ptr,   # *fp32 one per NESTED_BS scales (NESTED only)
    offset_ptr,    # *fp32 scalar added to the decoded scales (NESTED only)
    lut_ptr,       # *fp32 [16] the NF4 levels
    out_ptr,       # *fp16 n_elements, row-major [out_features, in_features]
    n_elements, n_bytes, n_blocks,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BS: tl.constexpr,
    NB: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """Dequantize the whole weight: program p handles blocks [p * NB, (p + 1) * NB)."""
    _dequant_blocks(tl.program_id(0), packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr,
                    lut_ptr, out_ptr, n_elements, n_bytes, n_blocks,
                    BLOCKSIZE, NESTED, NESTED_BS, NB, ROUND_BF16)


@triton.jit(do_not_specialize=["n_cast"])
def nf4_dequant_cast_kernel(
    packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, lut_ptr, out_ptr,
    n_elements, n_bytes, n_blocks,
    n_deq_programs,  # programs [0, n_deq_programs) dequantize (0: cast only)
    a_ptr, a16_ptr, b_ptr, b16_ptr, n_cast, scaling,  # the fp16 casts (see _cast_block)
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BS: tl.constexpr,
    NB: tl.constexpr, ROUND_BF16: tl.constexpr,
    CAST_A: tl.constexpr, CAST_B: tl.constexpr, CAST_BLOCK: tl.constexpr,
):
    """Programs below ``n_deq_programs`` dequantize the weight (as nf4_dequant_kernel), the others
    make the fp16 casts of ``_cast_block``."""
    pid = tl.program_id(0)
    if pid < n_deq_programs:
        _dequant_blocks(pid, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, lut_ptr,
                        out_ptr, n_elements, n_bytes, n_blocks,
                        BLOCKSIZE, NESTED, NESTED_BS, NB, ROUND_BF16)
    else:
        _cast_block(pid - n_deq_programs, a_ptr, a16_ptr, b_ptr, b16_ptr, n_cast, scaling,
                    CAST_A, CAST_B, CAST_BLOCK)


# fp16 casts fused into the dequantization launch: elements per program (GPU, interpreter)
GPU_CAST_BLOCK = 2048
INTERPRETER_CAST_BLOCK = 1 << 16
MAX_CAST_ELEMENTS = 2**31 - 2**17  # _cast_block indexes with int32

# Every tensor method on a Params4bit runs its Python __torch_function__: plans read the weight
# once, under this guard, and keep a plain-tensor alias of its bytes.
_no_torch_function = torch._C.DisableTorchFunctionSubclass

_offset_cache: dict = {}
_lut_cache: dict = {}


def _nf4_lut(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    lut = _lut_cache.get(key)
    if lut is None:
        lut = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
        _lut_cache[key] = lut
    return lut


def _offset_tensor(offset, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset if offset.dtype == torch.float32 else offset.float()
    key = (device.type, device.index, float(offset))
    t = _offset_cache.get(key)
    if t is None:
        t = torch.tensor([float(offset)], dtype=torch.float32, device=device)
        _offset_cache[key] = t
    return t


def unsupported_reason(weight: torch.Tensor, quant_state) -> str | None:
    """None when dequantize_nf4 handles this weight; else why not (callers fall back to bnb)."""
    qs = quant_state
    if qs is None:
        return "no quant_state"
    if getattr(qs, "quant_type", None) != "nf4":
        return f"quant_type {getattr(qs, 'quant_type', None)!r} is not nf4"
    bs = qs.blocksize
    if bs not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        return f"blocksize {bs} not supported"
    if getattr(qs, "packing_format_for_cpu", False):
        return "weight repacked for bnb's CPU inference format"
    if qs.shape is None:
        return "quant_state.shape unknown"
    n = math.prod(qs.shape)
    if n == 0 or n >= 2**31 - 8192:
        return f"{n} elements (int32 indexing)"
    if weight.numel() * weight.element_size() < (n + 1) // 2:
        return "packed weight smaller than the shape needs"
    if qs.nested:
        s2 = qs.state2
        if s2 is None or s2.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            return "nested state with unsupported second-level blocksize"
        if qs.absmax.dtype != torch.uint8:
            return f"nested absmax dtype {qs.absmax.dtype}"
        if s2.code is None or s2.code.numel() != 256:
            return "nested code map is not 256 entries"
    return None


class DequantPlan:
    """One NF4 weight's dequantization launch, prepared once (``launch``: one kernel call, no
    checks); a cached plan stays valid while ``matches`` holds."""

    __slots__ = ("qs", "absmax_src", "state2", "absmax2_src", "code2_src", "offset_src", "ptr",
                 "shape", "numel", "device", "args", "sizes", "n_deq_programs",
                 "cast_block", "blocks", "options")

    def __init__(self, weight: torch.Tensor, quant_state):
        reason = unsupported_reason(weight, quant_state)
        if reason is not None:
            raise ValueError(f"dequantize_nf4: {reason}")
        qs = quant_state
        with _no_torch_function():
            packed = weight.detach() if weight.dtype == torch.uint8 else weight.detach().view(torch.uint8)
            if not packed.is_contiguous():
                packed = packed.contiguous()
            self.ptr = weight.data_ptr()
            dev = weight.device
        self.qs, self.absmax_src = qs, qs.absmax
        self.shape = tuple(qs.shape)
        n = self.numel = math.prod(self.shape)
        self.device = dev
        bs = qs.blocksize
        n_blocks = cdiv(n, bs)
        if qs.nested:
            s2 = qs.state2
            self.state2, self.absmax2_src, self.code2_src, self.offset_src = s2, s2.absmax, s2.code, qs.offset
            absmax = qs.absmax
            code2 = s2.code if s2.code.dtype == torch.float32 else s2.code.float()
            absmax2 = s2.absmax if s2.absmax.dtype == torch.float32 else s2.absmax.float()
            offset = _offset_tensor(qs.offset, dev)
            nested_bs = s2.blocksize
        else:
            self.state2 = self.absmax2_src = self.code2_src = self.offset_src = None
            absmax = qs.absmax if qs.absmax.dtype == torch.float32 else qs.absmax.float()
            code2 = absmax2 = offset = absmax  # unused by the kernel when NESTED is False
            nested_bs = 256
        interp = dev.type != "cuda"
        nb = INTERPRETER_BLOCKS_PER_PROGRAM if interp else max(1, GPU_BLOCKS_PER_PROGRAM * 64 // bs)
        self.cast_block = INTERPRETER_CAST_BLOCK if interp else GPU_CAST_BLOCK
        self.n_deq_programs = cdiv(n_blocks, nb)
        self.args = (packed, absmax, code2, absmax2, offset, _nf4_lut(dev))
        self.sizes = (n, (n + 1) // 2, n_blocks)
        # the kernels' block constexprs, positionally in signature order (BLOCKSIZE, NESTED, NESTED_BS, NB)
        self.blocks = (bs, bool(qs.nested), nested_bs, nb)
        self.options = {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}

    def matches(self, weight: torch.Tensor, quant_state) -> bool:
        """The same QuantState and scale tensors (identity) and packed bytes at the same address."""
        qs = quant_state
        if qs is not self.qs or qs.absmax is not self.absmax_src:
            return False
        s2 = self.state2
        if s2 is not None and (qs.state2 is not s2 or s2.absmax is not self.absmax2_src
                               or s2.code is not self.code2_src or qs.offset is not self.offset_src):
            return False
        with _no_torch_function():
            return weight.data_ptr() == self.ptr

    def launch(self, out: torch.Tensor, round_bf16: bool = False, *, dequant: bool = True,
               a: torch.Tensor | None = None, a16: torch.Tensor | None = None,
               b: torch.Tensor | None = None, b16: torch.Tensor | None = None,
               cast_b: int = 0, scaling: float = 1.0) -> None:
        """Dequantize into ``out`` (fp16, contiguous, ``numel`` elements) and, when ``a`` is given,
        make ``_cast_block``'s casts in the same launch (a16 if given; cast_b 1 or 3 into b16). a, b,
        a16, b16: contiguous, the same number of elements (< MAX_CAST_ELEMENTS). ``dequant=False``:
        the casts only. round_bf16: round the weight through bf16 (bnb's backward, bf16 states)."""
        if a is None:
            launch(nf4_dequant_kernel, (self.n_deq_programs,), KERNEL_NAME,
                   *self.args, out, *self.sizes, *self.blocks, round_bf16, **self.options)
            return
        n_cast = a.numel()
        # unused pointers point at a valid tensor (the kernel never touches them)
        a16_ = out if a16 is None else a16
        b_ = a if b is None else b
        b16_ = out if b16 is None else b16
        n_deq = self.n_deq_programs if dequant else 0
        grid = (n_deq + cdiv(n_cast, self.cast_block),)
        launch(nf4_dequant_cast_kernel, grid, KERNEL_NAME + "_cast" if dequant else "fp16_cast",
               *self.args, out, *self.sizes, n_deq, a, a16_, b_, b16_, n_cast, float(scaling),
               *self.blocks, round_bf16, a16 is not None, cast_b, self.cast_block, **self.options)


def dequantize_nf4(weight: torch.Tensor, quant_state, out: torch.Tensor | None = None, *,
                   rounding_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A bitsandbytes NF4 weight (packed ``Params4bit`` data, any quant_storage dtype, and its
    ``QuantState``) as fp16 ``quant_state.shape``, into ``out`` (fp16 contiguous, prod(shape)
    elements) when given. rounding_dtype bf16: ``dequantize_4bit`` of a bf16 state then
    ``.to(torch.float16)``; fp16 / fp32: ``dequantize_4bit`` into fp16."""
    plan = DequantPlan(weight, quant_state)
    if out is None:
        out = torch.empty(plan.shape, dtype=torch.float16, device=plan.device)
    else:
        if out.dtype != torch.float16 or not out.is_contiguous() or out.numel() != plan.numel:
            raise ValueError("dequantize_nf4: out must be a contiguous fp16 tensor of prod(shape) elements")
        out = out.view(plan.shape)
    plan.launch(out, rounding_dtype == torch.bfloat16)
    return out


def sm75_specs():
    """The launch configurations used in training (blocksize 64; nested or not; with and without
    bf16 rounding), then the fused dequant + fp16 cast launches of the NF4 and LoRA layers."""
    common = {
        "packed_ptr": "*u8", "code2_ptr": "*fp32", "absmax2_ptr": "*fp32", "offset_ptr": "*fp32",
        "lut_ptr": "*fp32", "out_ptr": "*fp16", "n_elements": "i32", "n_bytes": "i32",
        "n_blocks": "i32", "BLOCKSIZE": "constexpr", "NESTED": "constexpr", "NESTED_BS": "constexpr",
        "NB": "constexpr", "ROUND_BF16": "constexpr",
    }
    options = {"enable_fp_fusion": False}
    for nested in (True, False):
        for round_bf16 in (False, True):
            sig = dict(common)
            sig["absmax_ptr"] = "*u8" if nested else "*fp32"
            yield {
                "name": f"nf4_dequant(nested={int(nested)},bf16_round={int(round_bf16)})",
                "fn": nf4_dequant_kernel,
                "signature": sig,
                "constexprs": {"BLOCKSIZE": 64, "NESTED": nested, "NESTED_BS": 256,
                               "NB": GPU_BLOCKS_PER_PROGRAM, "ROUND_BF16": round_bf16},
                "num_warps": GPU_NUM_WARPS, "options": options,
            }
    # (source dtype, CAST_A, CAST_B, bf16 rounding variants used)
    cast_variants = [("fp32", True, 0, (False, True)),   # NF4 linear: x / grad fp32 -> fp16
                     ("fp32", True, 1, (False,)),        # LoRA forward: x and dropout(x) -> fp16
                     ("fp32", True, 3, (False,)),        # LoRA forward: x, and dropout(x) from the mask
                     ("fp32", False, 3, (False,))]       # the layer node's v: dropout(x) only (x16 is q's)
    for src, cast_a, cast_b, roundings in cast_variants:
        for round_bf16 in roundings:
            sig = dict(common)
            b_ty = "*i1" if cast_b == 3 else f"*{src}"
            sig.update({"absmax_ptr": "*u8", "n_deq_programs": "i32", "a_ptr": f"*{src}", "a16_ptr": "*fp16",
                        "b_ptr": b_ty, "b16_ptr": "*fp16", "n_cast": "i32", "scaling": "fp32",
                        "CAST_A": "constexpr", "CAST_B": "constexpr", "CAST_BLOCK": "constexpr"})
            yield {
                "name": f"nf4_dequant_cast({src},A={int(cast_a)},B={cast_b},bf16_round={int(round_bf16)})",
                "fn": nf4_dequant_cast_kernel,
                "signature": sig,
                "constexprs": {"BLOCKSIZE": 64, "NESTED": True, "NESTED_BS": 256, "NB": GPU_BLOCKS_PER_PROGRAM,
                               "ROUND_BF16": round_bf16, "CAST_A": cast_a,
                               "CAST_B": cast_b, "CAST_BLOCK": GPU_CAST_BLOCK},
                "num_warps": GPU_NUM_WARPS, "options": options,
            }
