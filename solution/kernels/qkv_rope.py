"""Attention's way in and out for the decoder-layer node: q / k / v to attention's fp16 inputs in
one launch, and attention's input gradients back to the projections' fp16 gradients in one launch.

1. What it replaces. Between the projections and attention stock runs (per layer): peft's sum for
   q and v (fp32 q = fp32(base) + fp32(fp16(lora * scaling))), k's fp16 -> fp32 cast (bnb returns
   x's dtype), RoPE on q and k (transformers' ``apply_rotary_pos_emb``, fp32), ``repeat_kv`` of
   k's and v's 2 heads to 12 and the casts of q, k, v to fp16 (autocast's cast inside SDPA); and
   in backward the same in reverse: the repeated heads' gradients summed, RoPE's backward, the
   casts of q's, k's and v's fp32 gradients to fp16 (autograd's casts for the fp16 GEMMs, and
   fp16(g16 * scaling) for the LoRA B output). Each is an elementwise launch of its own.
2. Why that was slow. Each of those launches costs host time, plus an output allocation, and the
   eager step is host-bound on a fast GPU. On the GPU they are full passes through fp32
   intermediates: q [N, 1536] fp32 is written by the combine, read and written by RoPE, read by
   the pad; a GPU-bound T4 pays for that traffic.
3. What it does instead. ``qkv_rope_pad_kernel`` reads the fp16 GEMM outputs (q base, q LoRA, k,
   v base, v LoRA) and cos / sin once per token and writes q, k, v in attention's fp16 layout:
   the combine, RoPE and the cast in registers, k's and v's heads stored REP times.
   ``qkv_rope_unpad_kernel`` reads attention's fp16 dq, dk, dv and writes the five fp16 gradients
   the projections' GEMMs take: q's g16 and fp16(g16 * scaling), k's g16, v's g16 and
   fp16(g16 * scaling); k's and v's 6 head copies summed in fp32 first, RoPE's backward in fp32.
   The weights' dequantization launches then only dequantize. One launch each way.
4. Correctness risks. (a) Every value is computed with the fp32 operations stock runs, in the
   same order and with the same roundings (peft's fp16 round trip of the scaled LoRA output,
   RoPE's products and sums, the head sums starting from 0.0 in head order, each cast to fp16
   once): launched with ``enable_fp_fusion=False`` so no multiply-add becomes an FMA. Pinned bit
   for bit against PyTorch formulas of stock's operations written in tests/test_qkv_rope.py, and
   against fp64 with a bound derived from the roundings. (b) Shapes: head_dim even with a
   power-of-two half (one half-row is one tl.arange), cos / sin [1, N, head_dim] with unit stride
   on the last dim; the node checks ``supported`` and otherwise the step runs stock's forward.
   (c) Layout: q, k, v [N, heads *
   head_dim] contiguous; attention's tensors [N, heads, head_dim] with unit stride on head_dim.
5. How it was measured: docs/kernels/qkv_rope.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels._launches import cdiv, launch, pow2_at_least

GPU_NUM_WARPS = 4
# Tokens per program: one on the GPU (a token's 12 + 2 + 2 heads are ~2,000 elements, a normal
# amount of work for a memory-bound program); in the interpreter every tl operation costs Python
# time per program, so there a program takes as many tokens as fit INTERP_TILE_ELEMS elements.
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
    """For the BLOCK_T tokens t of this program:
    q = fp32(bq) + fp32(fp16(fp32(lq) * q_scaling)), RoPE'd, cast to fp16 -> qp[t, h, :];
    k = fp32(bk), RoPE'd, cast to fp16 -> kp[t, h * REP + g, :] for g < REP (repeat_kv);
    v = fp32(bv) + fp32(fp16(fp32(lv) * v_scaling)), cast to fp16 -> vp[t, h * REP + g, :].
    bq, lq: [N, HQ * 2 * HALF] fp16; bk, bv, lv: [N, HK * 2 * HALF] fp16; cos, sin: rows of
    2 * HALF values cs_row apart; qp: [N, HQ, 2 * HALF], kp, vp: [N, HK * REP, 2 * HALF] fp16, all
    contiguous."""
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
    """The backward of qkv_rope_pad_kernel up to the projections' fp16 GEMM inputs, for the
    BLOCK_T tokens t of this program (attention's gradients dq, dk, dv: [N, HQ, 2 * HALF] fp16,
    rows and heads at the given strides, unit stride on the last dim):
    q: r = RoPE backward of fp32(dq[t]); gq = fp16(r), gsq = fp16(fp32(gq) * q_scaling);
    k (NEED_K): r = RoPE backward of the fp32 sum of dk[t, h * REP + g] over g; gk = fp16(r);
    v: r = the fp32 sum of dv[t, h * REP + g] over g; gv = fp16(r), gsv = fp16(fp32(gv) * v_scaling).
    gq, gsq: [N, HQ * 2 * HALF]; gk, gv, gsv: [N, HK * 2 * HALF]; fp16, contiguous."""
    D: tl.constexpr = 2 * HALF
    t64, d, cs_ok, c1, s1, c2, s2 = _token_tables(cos_ptr, sin_ptr, n_tokens, cs_row, HALF, BLOCK_T)

    hq = tl.arange(0, HQP2)[None, :, None]
    q_ok = cs_ok & (hq < HQ)
    # q's heads "summed" over one copy from 0.0, as unpad_rows_kernel did for q (REP 1): 0.0 + (-0.0)
    # is +0.0, so a zero's sign is the old path's too
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


# --------------------------------------------------------------------------------------------------
# launchers

def supported(head_dim: int, cos: torch.Tensor) -> bool:
    """Shapes the kernels take: an even head_dim whose half is a power of two, cos / sin fp32 or
    fp16 [1, N, head_dim] with unit stride on the last dim (the node makes them so)."""
    half = head_dim // 2
    return (head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0 and cos.dim() == 3 and cos.shape[0] == 1
            and cos.shape[-1] == head_dim and cos.stride(-1) == 1 and cos.dtype in (torch.float16, torch.float32))


def _block_t(n: int, heads_p2: int, half: int, device: torch.device) -> int:
    if device.type == "cuda":
        return 1
    return max(1, min(pow2_at_least(max(n, 1)), INTERP_TILE_ELEMS // (heads_p2 * half)))


def forward(bq16, lq16, q_scaling: float, bk16, bv16, lv16, v_scaling: float, cos, sin,
            n_heads: int, n_kv: int, head_dim: int):
    """(qp, kp, vp): attention's fp16 inputs [1, N, heads, head_dim] (k and v with their heads
    repeated to n_heads) from the projections' fp16 GEMM outputs ([.., N, heads * head_dim],
    contiguous): qkv_rope_pad_kernel. cos, sin: [1, N, head_dim] (``supported``)."""
    n = cos.shape[1]
    dev = bq16.device
    rep = n_heads // n_kv
    # one allocation for the three outputs (they live as long as each other: attention saves all
    # three); each is a contiguous slice of it
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
    """(gq16, gsq16, gk16 or None, gv16, gsv16), each [1, N, heads * head_dim] fp16, from
    attention's gradients dq, dk, dv [1, N, n_heads, head_dim] (any row / head strides, unit stride
    on head_dim): qkv_rope_unpad_kernel."""
    _, n, n_heads, head_dim = dq.shape
    dev = dq.device
    rep = n_heads // n_kv
    f16 = torch.float16
    # one allocation for the outputs (the GEMMs take them one after another, in one node call);
    # each is a contiguous [1, N, width] slice of it
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
    """The workload's launches: 12 query heads, 2 KV heads repeated 6 times, head_dim 128, one token
    per program; cos / sin fp32 (the residual's dtype); k's gradient needed or not (layer 0)."""
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
