"""Attention's way in and out for the decoder-layer node, one launch each way: ``forward`` (the
projections' fp16 GEMM outputs -> peft's q / v sums, RoPE on q and k, k's and v's heads repeated:
attention's fp16 inputs) and ``backward`` (attention's fp16 dq, dk, dv -> the five fp16 gradients
the projections' GEMMs take), with stock's fp32 operations in its order (``enable_fp_fusion=False``).
``supported`` says which shapes they take.
What it replaces, why, risks, measurements: docs/kernels/qkv_rope.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels._launches import cdiv, launch, pow2_at_least

GPU_NUM_WARPS = 4
# Tokens per program: one on the GPU (~2,000 elements); in the interpreter, which pays per tl op
# per program, as many as fit INTERP_TILE_ELEMS elements.
INTERP_TILE_ELEMS = 1 << 16


@triton.jit
def _rope_fwd(x1, x2, c1, s1, c2, s2):
    """RoPE's forward on the two fp32 halves: x * cos + rotate_half(x) * sin's products and sums (b1 = -s1, b2 = s2)."""
    return x1 * c1 + x2 * (-s1), x2 * c2 + x1 * s2


@triton.jit
def _rope_bwd(g1, g2, c1, s1, c2, s2):
    """RoPE's backward (the transposed map): the forward's with b1 = s2, b2 = -s1."""
    return g1 * c1 + g2 * s2, g2 * c2 + g1 * (-s1)


@triton.jit
def _token_tables(cos_ptr, sin_ptr, n_tokens, cs_row, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's BLOCK_T tokens: (t64 [BLOCK_T, 1, 1] int64, d [1, 1, HALF], the tokens' mask
    [BLOCK_T, 1, 1], and their cos / sin halves c1, s1, c2, s2 [BLOCK_T, 1, HALF] in fp32)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t64 = tok.to(tl.int64)[:, None, None]
    d = tl.arange(0, HALF)[None, None, :]
    cs = t64 * cs_row + d
    cs_ok = (tok < n_tokens)[:, None, None]
    c1 = tl.load(cos_ptr + cs, mask=cs_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=cs_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)
    return t64, d, cs_ok, c1, s1, c2, s2


@triton.jit
def _lora_sum(base_ptr, lora_ptr, offs, mask, scaling):
    """fp32(base) + fp32(fp16(fp32(lora) * scaling)): peft's sum (its fp16 ``* scaling``, then the fp32 add)."""
    base = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lora = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return base + (lora * scaling).to(tl.float16).to(tl.float32)


@triton.jit(do_not_specialize=["n_tokens"])
def qkv_rope_pad_kernel(bq_ptr, lq_ptr, bk_ptr, bv_ptr, lv_ptr, cos_ptr, sin_ptr,
                        qp_ptr, kp_ptr, vp_ptr, n_tokens, cs_row, q_scaling, v_scaling,
                        HQ: tl.constexpr, HK: tl.constexpr, REP: tl.constexpr, HALF: tl.constexpr,
                        HQP2: tl.constexpr, HKP2: tl.constexpr, BLOCK_T: tl.constexpr):
    """For this program's BLOCK_T tokens t: qp[t, h] = fp16(RoPE(fp32(bq) + fp32(fp16(fp32(lq) *
    q_scaling)))); kp[t, h * REP + g] = fp16(RoPE(fp32(bk))) and vp[t, h * REP + g] = fp16(fp32(bv)
    + fp32(fp16(fp32(lv) * v_scaling))) for g < REP. bq, lq [N, HQ * 2 * HALF], bk, bv, lv
    [N, HK * 2 * HALF], qp [N, HQ, 2 * HALF], kp, vp [N, HK * REP, 2 * HALF]: fp16, contiguous;
    cos, sin: rows of 2 * HALF values cs_row apart."""
    D: tl.constexpr = 2 * HALF
    t64, d, cs_ok, c1, s1, c2, s2 = _token_tables(cos_ptr, sin_ptr, n_tokens, cs_row, HALF, BLOCK_T)

    # q: [BLOCK_T, HQP2, HALF]
    hq = tl.arange(0, HQP2)[None, :, None]
    q_ok = cs_ok & (hq < HQ)
    q_offs = t64 * (HQ * D) + hq * D + d
    x1 = _lora_sum(bq_ptr, lq_ptr, q_offs, q_ok, q_scaling)
    x2 = _lora_sum(bq_ptr, lq_ptr, q_offs + HALF, q_ok, q_scaling)
    o1, o2 = _rope_fwd(x1, x2, c1, s1, c2, s2)
    tl.store(qp_ptr + q_offs, o1.to(tl.float16), mask=q_ok)
    tl.store(qp_ptr + q_offs + HALF, o2.to(tl.float16), mask=q_ok)

    # k and v: [BLOCK_T, HKP2, HALF], each head stored REP times
    hk = tl.arange(0, HKP2)[None, :, None]
    k_ok = cs_ok & (hk < HK)
    kv_offs = t64 * (HK * D) + hk * D + d
    k1 = tl.load(bk_ptr + kv_offs, mask=k_ok, other=0.0).to(tl.float32)
    k2 = tl.load(bk_ptr + kv_offs + HALF, mask=k_ok, other=0.0).to(tl.float32)
    k1, k2 = _rope_fwd(k1, k2, c1, s1, c2, s2)
    k1 = k1.to(tl.float16)
    k2 = k2.to(tl.float16)
    v1 = _lora_sum(bv_ptr, lv_ptr, kv_offs, k_ok, v_scaling).to(tl.float16)
    v2 = _lora_sum(bv_ptr, lv_ptr, kv_offs + HALF, k_ok, v_scaling).to(tl.float16)
    for g in tl.static_range(REP):
        out = t64 * (HK * REP * D) + (hk * REP + g) * D + d
        tl.store(kp_ptr + out, k1, mask=k_ok)
        tl.store(kp_ptr + out + HALF, k2, mask=k_ok)
        tl.store(vp_ptr + out, v1, mask=k_ok)
        tl.store(vp_ptr + out + HALF, v2, mask=k_ok)


@triton.jit
def _head_sums(src_ptr, t64, row, head, hk, d, ok,
               HALF: tl.constexpr, REP: tl.constexpr, BLOCK_T: tl.constexpr, HKP2: tl.constexpr):
    """The fp32 sums over g < REP of src[t, hk * REP + g, :] (both halves), from 0.0 in head order:
    autograd's sum for repeat_kv's backward."""
    acc1 = tl.zeros([BLOCK_T, HKP2, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_T, HKP2, HALF], dtype=tl.float32)
    for g in tl.static_range(REP):
        offs = t64 * row + (hk * REP + g).to(tl.int64) * head + d
        acc1 += tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        acc2 += tl.load(src_ptr + offs + HALF, mask=ok, other=0.0).to(tl.float32)
    return acc1, acc2


@triton.jit
def _store_pair(g_ptr, gs_ptr, offs, ok, r1, r2, scaling, HALF: tl.constexpr, SCALED: tl.constexpr):
    """g16 = fp16(r) and, when SCALED, gs16 = fp16(fp32(g16) * scaling) (the LoRA B output's
    gradient, peft's fp16 ``* scaling``): r1 at offs, r2 at offs + HALF."""
    g1 = r1.to(tl.float16)
    g2 = r2.to(tl.float16)
    tl.store(g_ptr + offs, g1, mask=ok)
    tl.store(g_ptr + offs + HALF, g2, mask=ok)
    if SCALED:
        tl.store(gs_ptr + offs, (g1.to(tl.float32) * scaling).to(tl.float16), mask=ok)
        tl.store(gs_ptr + offs + HALF, (g2.to(tl.float32) * scaling).to(tl.float16), mask=ok)


@triton.jit(do_not_specialize=["n_tokens"])
def qkv_rope_unpad_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr,
                          gq_ptr, gsq_ptr, gk_ptr, gv_ptr, gsv_ptr, n_tokens,
                          dq_row, dq_head, dk_row, dk_head, dv_row, dv_head, cs_row, q_scaling, v_scaling,
                          HQ: tl.constexpr, HK: tl.constexpr, REP: tl.constexpr, HALF: tl.constexpr,
                          HQP2: tl.constexpr, HKP2: tl.constexpr, BLOCK_T: tl.constexpr,
                          NEED_K: tl.constexpr):
    """qkv_rope_pad_kernel's backward for this program's BLOCK_T tokens, from dq, dk, dv [N, HQ,
    2 * HALF] fp16 (given row / head strides, unit last stride): gq = fp16(RoPE backward of dq),
    gk (NEED_K) = fp16(RoPE backward of the head sums of dk), gv = fp16(head sums of dv), gsq / gsv
    = fp16(fp32(g) * scaling). gq, gsq [N, HQ * 2 * HALF], gk, gv, gsv [N, HK * 2 * HALF], fp16."""
    D: tl.constexpr = 2 * HALF
    t64, d, cs_ok, c1, s1, c2, s2 = _token_tables(cos_ptr, sin_ptr, n_tokens, cs_row, HALF, BLOCK_T)

    hq = tl.arange(0, HQP2)[None, :, None]
    q_ok = cs_ok & (hq < HQ)
    # q's heads "summed" over one copy from 0.0, like k's and v's (a -0.0 comes out +0.0)
    g1, g2 = _head_sums(dq_ptr, t64, dq_row, dq_head, hq, d, q_ok, HALF, 1, BLOCK_T, HQP2)
    r1, r2 = _rope_bwd(g1, g2, c1, s1, c2, s2)
    q_offs = t64 * (HQ * D) + hq * D + d
    _store_pair(gq_ptr, gsq_ptr, q_offs, q_ok, r1, r2, q_scaling, HALF, True)

    hk = tl.arange(0, HKP2)[None, :, None]
    k_ok = cs_ok & (hk < HK)
    kv_offs = t64 * (HK * D) + hk * D + d
    if NEED_K:
        a1, a2 = _head_sums(dk_ptr, t64, dk_row, dk_head, hk, d, k_ok, HALF, REP, BLOCK_T, HKP2)
        a1, a2 = _rope_bwd(a1, a2, c1, s1, c2, s2)
        _store_pair(gk_ptr, gk_ptr, kv_offs, k_ok, a1, a2, 1.0, HALF, False)
    b1, b2 = _head_sums(dv_ptr, t64, dv_row, dv_head, hk, d, k_ok, HALF, REP, BLOCK_T, HKP2)
    _store_pair(gv_ptr, gsv_ptr, kv_offs, k_ok, b1, b2, v_scaling, HALF, True)


def supported(head_dim: int, cos: torch.Tensor) -> bool:
    """An even head_dim whose half is a power of two; cos / sin fp32 or fp16 [1, N, head_dim] with
    unit stride on the last dim."""
    half = head_dim // 2
    return (head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0 and cos.dim() == 3 and cos.shape[0] == 1
            and cos.shape[-1] == head_dim and cos.stride(-1) == 1 and cos.dtype in (torch.float16, torch.float32))


def _block_t(n: int, heads_p2: int, half: int, device: torch.device) -> int:
    if device.type == "cuda":
        return 1
    return max(1, min(pow2_at_least(max(n, 1)), INTERP_TILE_ELEMS // (heads_p2 * half)))


def forward(bq16, lq16, q_scaling: float, bk16, bv16, lv16, v_scaling: float, cos, sin,
            n_heads: int, n_kv: int, head_dim: int):
    """(qp, kp, vp): attention's fp16 inputs [1, N, n_heads, head_dim] from the projections' fp16
    GEMM outputs ([.., N, heads * head_dim], contiguous); cos, sin [1, N, head_dim]."""
    n = cos.shape[1]
    dev = bq16.device
    rep = n_heads // n_kv
    # one allocation for the three outputs (attention saves all three), contiguous slices
    qp, kp, vp = torch.empty((3, n, n_heads, head_dim), dtype=torch.float16, device=dev).split(1)
    if n:
        half = head_dim // 2
        hq2 = pow2_at_least(n_heads)
        block_t = _block_t(n, hq2, half, dev)
        ptrs = (bq16, lq16, bk16, bv16, lv16, cos, sin, qp, kp, vp)
        cs_row = cos.stride(1)
        consts = (n_heads, n_kv, rep, half, hq2, pow2_at_least(n_kv), block_t)
        launch(qkv_rope_pad_kernel, (cdiv(n, block_t),), "qkv_rope_pad",
               *ptrs, n, cs_row, float(q_scaling), float(v_scaling), *consts,
               num_warps=GPU_NUM_WARPS, enable_fp_fusion=False)
    return qp, kp, vp


def backward(dq, dk, dv, cos, sin, q_scaling: float, v_scaling: float, n_kv: int, need_k: bool):
    """(gq16, gsq16, gk16 or None, gv16, gsv16), each [1, N, heads * head_dim] fp16, from dq, dk, dv
    [1, N, n_heads, head_dim] (any row / head strides, unit stride on head_dim)."""
    _, n, n_heads, head_dim = dq.shape
    dev = dq.device
    rep = n_heads // n_kv
    f16 = torch.float16
    # one allocation for the outputs, each a contiguous [1, N, width] slice
    widths = (n_heads * head_dim,) * 2 + (n_kv * head_dim,) * (3 if need_k else 2)
    parts = torch.empty(n * sum(widths), dtype=f16, device=dev).split([n * w for w in widths])
    gq, gsq, *rest = (t.view(1, n, w) for t, w in zip(parts, widths))
    gk, gv, gsv = rest if need_k else (None, *rest)
    if n:
        half = head_dim // 2
        hq2 = pow2_at_least(n_heads)
        block_t = _block_t(n, hq2, half, dev)
        ptrs = (dq, dk, dv, cos, sin, gq, gsq, gv if gk is None else gk, gv, gsv)
        strides = (dq.stride(1), dq.stride(2), dk.stride(1), dk.stride(2), dv.stride(1), dv.stride(2), cos.stride(1))
        consts = (n_heads, n_kv, rep, half, hq2, pow2_at_least(n_kv), block_t, need_k)
        launch(qkv_rope_unpad_kernel, (cdiv(n, block_t),), "qkv_rope_unpad",
               *ptrs, n, *strides, float(q_scaling), float(v_scaling), *consts,
               num_warps=GPU_NUM_WARPS, enable_fp_fusion=False)
    return gq, gsq, gk, gv, gsv


def sm75_specs():
    """The workload's launches: 12 query heads, 2 KV heads x 6, head_dim 128, one token a program,
    cos / sin fp32; k's gradient needed or not (layer 0)."""
    consts = {"HQ": 12, "HK": 2, "REP": 6, "HALF": 64, "HQP2": 16, "HKP2": 2, "BLOCK_T": 1}
    yield {
        "name": "qkv_rope_pad", "fn": qkv_rope_pad_kernel, "num_warps": GPU_NUM_WARPS,
        "signature": {"bq_ptr": "*fp16", "lq_ptr": "*fp16", "bk_ptr": "*fp16", "bv_ptr": "*fp16", "lv_ptr": "*fp16",
                      "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qp_ptr": "*fp16", "kp_ptr": "*fp16",
                      "vp_ptr": "*fp16", "n_tokens": "i32", "cs_row": "i32", "q_scaling": "fp32",
                      "v_scaling": "fp32", **{k: "constexpr" for k in consts}},
        "constexprs": consts, "options": {"enable_fp_fusion": False},
    }
    for need_k in (True, False):
        c = {**consts, "NEED_K": need_k}
        yield {
            "name": f"qkv_rope_unpad(need_k={need_k})", "fn": qkv_rope_unpad_kernel, "num_warps": GPU_NUM_WARPS,
            "signature": {"dq_ptr": "*fp16", "dk_ptr": "*fp16", "dv_ptr": "*fp16", "cos_ptr": "*fp32",
                          "sin_ptr": "*fp32", "gq_ptr": "*fp16", "gsq_ptr": "*fp16", "gk_ptr": "*fp16",
                          "gv_ptr": "*fp16", "gsv_ptr": "*fp16", "n_tokens": "i32", "dq_row": "i32",
                          "dq_head": "i32", "dk_row": "i32", "dk_head": "i32", "dv_row": "i32", "dv_head": "i32",
                          "cs_row": "i32", "q_scaling": "fp32", "v_scaling": "fp32",
                          **{k: "constexpr" for k in c}},
            "constexprs": c, "options": {"enable_fp_fusion": False},
        }
