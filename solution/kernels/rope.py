"""Rotary position embedding (RoPE) for q and k in one launch, forward + backward
(replaces ``transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb``).

Stock computes, for q [B, Hq, L, D] and k [B, Hk, L, D] with cos/sin [B or 1, L, D]:

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

i.e. with the two halves x1 = x[..., :D/2], x2 = x[..., D/2:] (c1/c2, s1/s2 the halves of cos/sin):

    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2

That is 5 elementwise kernels per tensor (neg, cat, two muls, add; the slices are views), 10 per
call, each a full pass over memory. Here one program handles BLOCK_T consecutive tokens (b, l): it
loads their cos/sin rows once and rotates all Hq + Hk heads of them as [BLOCK_T, heads, D/2] tiles,
reading q/k once and writing once, q and k in the same launch.

Tokens per program (BLOCK_T): on the GPU 1 (a token's 12 + 2 heads x 128 values are ~1800
elements, 7 KB of fp32 in and 7 KB out: a normal amount of work per program for a memory-bound
kernel; more tokens per program would not read cos/sin less, since every token has its own row,
and the launch overhead on the CPU side does not depend on the grid size). In Triton's CPU interpreter each tl
operation costs a fixed Python overhead per program, so there the launcher takes as many tokens as
fit a tile of INTERP_TILE_ELEMS elements (all 2048 tokens of the tiny CI model in one program).

Backward is the transposed linear map (grad of cos/sin is not supported: they never require grad
in Qwen2, and the patch falls back to stock when they do):

    dx1 = g1 * c1 + g2 * s2
    dx2 = g2 * c2 - g1 * s1

(for Qwen2's cos/sin, whose two halves are equal, this is the rotation by -angle). The same
kernel does both directions; only the signs/halves of the sin factors differ.

Dtypes: arithmetic in fp32, outputs in promote(q.dtype, cos.dtype) like stock's `q * cos`; input
gradients in q's / k's dtype. Products and sums are rounded to the result dtype exactly where
stock rounds them, and fused multiply-add is off, so results equal stock's bit for bit in fp32,
fp16 and mixed dtypes. (In the workload everything is fp32: bitsandbytes' Linear4bit returns its
input's dtype, the input is the fp32 normed residual, and cos/sin take the residual's dtype.)

Layout: q/k may have any strides as long as the last dim is unit stride (the projections'
view + transpose gives exactly that); outputs keep q's / k's layout (torch.empty_like), as stock's
elementwise ops do, and input grads are allocated in that same layout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from solution.env import interpreter_enabled
from solution.kernels._launches import cdiv, launch, pow2_at_least

_SUPPORTED_DTYPES = (torch.float16, torch.float32)
MAX_HEAD_DIM = 512  # head_dim above this is left to stock (one half-row lives in registers)
MAX_TILE = 4096     # elements per [heads, D/2] tile; heads beyond are processed in more tiles


@triton.jit
def _rope_rotate_heads(src_ptr, dst_ptr, src_tok, dst_tok, tok_mask, n_heads, src_head_stride, dst_head_stride,
                       half, a1, b1, a2, b2, d_offsets, d_mask,
                       BLOCK_H: tl.constexpr, N_TILES: tl.constexpr):
    """For the BLOCK_T tokens of this program (element offsets src_tok / dst_tok of their head 0,
    tok_mask for the valid ones) and each head h < n_heads:
    dst1 = src1 * a1 + src2 * b1, dst2 = src2 * a2 + src1 * b2 (halves of length `half`;
    a1, b1, a2, b2 are [BLOCK_T, 1, BLOCK_D] factors, the same for every head of a token).

    Tiles are [BLOCK_T, BLOCK_H, BLOCK_D]: token x head x position in the half.
    Computed in fp32 but rounded like stock: each product and the sum are rounded to the
    destination dtype (stock's `q * cos`, `rotate_half(q) * sin` and their sum are separate ops
    in that dtype; in backward, autograd rounds each grad term to q's dtype before adding them).
    For fp32 the roundings are no-ops; for fp16 this reproduces stock bit for bit."""
    out_ty = dst_ptr.dtype.element_ty
    for tile in tl.static_range(N_TILES):
        heads = tile * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = tok_mask[:, None, None] & (heads < n_heads)[None, :, None] & d_mask[None, None, :]
        heads64 = heads[None, :, None].to(tl.int64)
        src = src_ptr + src_tok[:, None, None] + heads64 * src_head_stride + d_offsets[None, None, :]
        dst = dst_ptr + dst_tok[:, None, None] + heads64 * dst_head_stride + d_offsets[None, None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        out1 = (x1 * a1).to(out_ty).to(tl.float32) + (x2 * b1).to(out_ty).to(tl.float32)
        out2 = (x2 * a2).to(out_ty).to(tl.float32) + (x1 * b2).to(out_ty).to(tl.float32)
        tl.store(dst, out1.to(out_ty), mask=mask)
        tl.store(dst + half, out2.to(out_ty), mask=mask)


@triton.jit(do_not_specialize=["n_tokens", "seq_len"])
def _rope_qk_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                    n_tokens, seq_len, n_q_heads, n_k_heads, half,
                    q_sb, q_sh, q_sl, k_sb, k_sh, k_sl,
                    qo_sb, qo_sh, qo_sl, ko_sb, ko_sh, ko_sl,
                    cos_sb, cos_sl, sin_sb, sin_sl,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                    BLOCK_HK: tl.constexpr, Q_TILES: tl.constexpr, K_TILES: tl.constexpr,
                    BACKWARD: tl.constexpr):
    """Rotate every q head and every k head of the BLOCK_T tokens t = program_id * BLOCK_T + i
    (t < n_tokens = batch * seq_len; (b, l) = divmod(t, seq_len), so a program may span two
    sequences of the batch).

    Forward (BACKWARD=False): out1 = x1*c1 - x2*s1, out2 = x2*c2 + x1*s2.
    Backward (BACKWARD=True), the transposed map: dx1 = g1*c1 + g2*s2, dx2 = g2*c2 - g1*s1.
    Strides are in elements; the last dim of every tensor is unit stride. A broadcast batch of
    cos/sin has stride 0. n_q_heads = 0 (or n_k_heads = 0) skips that tensor."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    b = (tok // seq_len).to(tl.int64)
    l = (tok % seq_len).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < half
    cs_mask = tok_mask[:, None] & d_mask[None, :]
    cos_row = (cos_ptr + b * cos_sb + l * cos_sl)[:, None] + d[None, :]
    sin_row = (sin_ptr + b * sin_sb + l * sin_sl)[:, None] + d[None, :]
    # [BLOCK_T, 1, BLOCK_D]: one cos/sin row per token, broadcast over its heads.
    c1 = tl.load(cos_row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_row + half, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(sin_row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(sin_row + half, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    if BACKWARD:
        b1 = s2
        b2 = -s1
    else:
        b1 = -s1
        b2 = s2
    _rope_rotate_heads(q_ptr, q_out_ptr, b * q_sb + l * q_sl, b * qo_sb + l * qo_sl, tok_mask, n_q_heads,
                       q_sh, qo_sh, half, c1, b1, c2, b2, d, d_mask, BLOCK_HQ, Q_TILES)
    _rope_rotate_heads(k_ptr, k_out_ptr, b * k_sb + l * k_sl, b * ko_sb + l * ko_sl, tok_mask, n_k_heads,
                       k_sh, ko_sh, half, c1, b1, c2, b2, d, d_mask, BLOCK_HK, K_TILES)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _head_tiles(n_heads: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_H, number of tiles) covering n_heads with per-token tiles of at most MAX_TILE elements."""
    block_h = min(pow2_at_least(max(n_heads, 1)), max(1, MAX_TILE // block_d))
    return block_h, max(1, cdiv(n_heads, block_h))


# How many elements one program's [BLOCK_T, BLOCK_H, BLOCK_D] tile may hold. 0 means one token per
# program (the GPU choice, see the module docstring). In Triton's CPU interpreter every tl
# operation costs a fixed Python overhead per program, so there programs take big tiles: 2**16
# elements. Tests set both to other values (multi-token tiles with a partial last tile); the GPU
# benchmark sweeps GPU_TILE_ELEMS to check the choice.
GPU_TILE_ELEMS = 0
INTERP_TILE_ELEMS = 1 << 16


def _pow2_at_most(n: int) -> int:
    """The largest power of two <= n (1 for n < 1): tl.arange needs power-of-two sizes."""
    return 1 << (max(n, 1).bit_length() - 1)


def _tokens_per_program(n_tokens: int, token_elems: int) -> int:
    """BLOCK_T: as many tokens as fit the tile (at least 1, at most what the input has)."""
    tile = INTERP_TILE_ELEMS if interpreter_enabled() else GPU_TILE_ELEMS
    return min(pow2_at_least(max(n_tokens, 1)), _pow2_at_most(tile // token_elems))


def _launch_config(n_tokens: int, n_q: int, n_k: int, head_dim: int) -> dict:
    """The constexprs of one launch."""
    block_d = pow2_at_least(head_dim // 2)
    block_hq, q_tiles = _head_tiles(n_q, block_d)
    block_hk, k_tiles = _head_tiles(n_k, block_d)
    block_t = _tokens_per_program(n_tokens, max(block_hq, block_hk) * block_d)
    return {"BLOCK_T": block_t, "BLOCK_D": block_d, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk,
            "Q_TILES": q_tiles, "K_TILES": k_tiles}


def _num_warps(block_t: int) -> int:
    """4 warps per token (the one-token GPU config: 64 registers, no spills on sm_75), at most 16."""
    return min(16, 4 * block_t)


def _launch(q, k, q_out, k_out, cos, sin, backward: bool) -> None:
    """q/k (or the grads) -> q_out/k_out. q or q_out may be None (that side is skipped)."""
    ref = q if q is not None else k
    batch, _, seq_len, head_dim = ref.shape
    n_tokens = batch * seq_len
    if n_tokens == 0:
        return
    half = head_dim // 2
    n_q = q.shape[1] if q is not None else 0
    n_k = k.shape[1] if k is not None else 0
    # A skipped side gets the other side's tensors as harmless placeholders (zero heads are read).
    q_in, q_o = (q, q_out) if q is not None else (k, k_out)
    k_in, k_o = (k, k_out) if k is not None else (q, q_out)
    config = _launch_config(n_tokens, n_q, n_k, head_dim)
    cos_sb = cos.stride(0) if cos.shape[0] > 1 else 0
    sin_sb = sin.stride(0) if sin.shape[0] > 1 else 0
    launch(_rope_qk_kernel, (cdiv(n_tokens, config["BLOCK_T"]),), "_rope_qk_kernel",
           q_in, k_in, q_o, k_o, cos, sin, n_tokens, seq_len, n_q, n_k, half,
           q_in.stride(0), q_in.stride(1), q_in.stride(2), k_in.stride(0), k_in.stride(1), k_in.stride(2),
           q_o.stride(0), q_o.stride(1), q_o.stride(2), k_o.stride(0), k_o.stride(1), k_o.stride(2),
           cos_sb, cos.stride(1), sin_sb, sin.stride(1),
           **config, BACKWARD=backward, num_warps=_num_warps(config["BLOCK_T"]),
           # No fused multiply-add: products and sums rounded separately, exactly like stock's ops,
           # so fp32 results also equal stock bit for bit.
           enable_fp_fusion=False)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_supported(q, k, cos, sin) -> bool:
    """Shapes/dtypes the kernel handles (device is checked by the caller):
    q [B, Hq, L, D], k [B, Hk, L, D] same dtype; cos, sin [B or 1, L, D] same dtype; D even;
    fp16/fp32; cos/sin not requiring grad."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    batch, _, seq_len, head_dim = q.shape
    return (q.dtype in _SUPPORTED_DTYPES and k.dtype == q.dtype
            and cos.dtype in _SUPPORTED_DTYPES and sin.dtype == cos.dtype
            and k.shape[0] == batch and k.shape[2] == seq_len and k.shape[3] == head_dim
            and head_dim % 2 == 0 and 0 < head_dim <= MAX_HEAD_DIM
            and cos.shape[0] in (1, batch) and cos.shape[1] == seq_len and cos.shape[2] == head_dim
            and not cos.requires_grad and not sin.requires_grad
            and q.device == k.device == cos.device == sin.device)


class RoPEFunction(torch.autograd.Function):
    """autograd wrapper; saves only cos and sin (backward does not need q or k)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = _unit_last(cos), _unit_last(sin)
        q_in, k_in = _unit_last(q), _unit_last(k)
        out_dtype = torch.promote_types(q.dtype, cos.dtype)
        # empty_like keeps q's memory layout ([B, L, H, D] physically for the projections' views).
        q_out = torch.empty_like(q_in, dtype=out_dtype)
        k_out = torch.empty_like(k_in, dtype=out_dtype)
        _launch(q_in, k_in, q_out, k_out, cos, sin, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.q_layout = (q.shape, q_out.stride(), q.dtype)
        ctx.k_layout = (k.shape, k_out.stride(), k.dtype)
        ctx.set_materialize_grads(False)
        # Like stock: an output whose input does not require grad does not require grad either.
        if not ctx.needs_input_grad[0]:
            ctx.mark_non_differentiable(q_out)
        if not ctx.needs_input_grad[1]:
            ctx.mark_non_differentiable(k_out)
        return q_out, k_out

    @staticmethod
    @once_differentiable  # no double backward: raise instead of silently wrong 2nd derivatives
    def backward(ctx, grad_q_out, grad_k_out):
        cos, sin = ctx.saved_tensors
        grad_q = grad_k = None
        want_q = ctx.needs_input_grad[0] and grad_q_out is not None
        want_k = ctx.needs_input_grad[1] and grad_k_out is not None
        gq = _unit_last(grad_q_out) if want_q else None
        gk = _unit_last(grad_k_out) if want_k else None
        if want_q:  # allocate the grads in q's / k's own layout so view/transpose backward is free
            shape, stride, dtype = ctx.q_layout
            grad_q = torch.empty_strided(shape, stride, dtype=dtype, device=cos.device)
        if want_k:
            shape, stride, dtype = ctx.k_layout
            grad_k = torch.empty_strided(shape, stride, dtype=dtype, device=cos.device)
        if want_q or want_k:
            _launch(gq, gk, grad_q, grad_k, cos, sin, backward=True)
        return grad_q, grad_k, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Same as ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` for rope_supported() inputs.

    q [B, Hq, L, D], k [B, Hk, L, D] (fp16/fp32, any strides), cos/sin [B or 1, L, D] (fp16/fp32).
    Returns (q_embed, k_embed) in promote(q.dtype, cos.dtype), same shapes and layouts as q, k."""
    return RoPEFunction.apply(q, k, cos, sin)


# --------------------------------------------------------------------------------------------------
# sm_75 compile check
# --------------------------------------------------------------------------------------------------
_TRITON_TYPE = {torch.float16: "*fp16", torch.float32: "*fp32"}


def _spec(qk_dt, cs_dt, backward: bool, head_dim: int, n_q: int, n_k: int, gpu_tile_elems: int, label: str):
    out_dt = torch.promote_types(qk_dt, cs_dt)
    src_dt, dst_dt = (out_dt, qk_dt) if backward else (qk_dt, out_dt)
    sig = {"q_ptr": _TRITON_TYPE[src_dt], "k_ptr": _TRITON_TYPE[src_dt],
           "q_out_ptr": _TRITON_TYPE[dst_dt], "k_out_ptr": _TRITON_TYPE[dst_dt],
           "cos_ptr": _TRITON_TYPE[cs_dt], "sin_ptr": _TRITON_TYPE[cs_dt]}
    for name in ("n_tokens", "seq_len", "n_q_heads", "n_k_heads", "half", "q_sb", "q_sh", "q_sl", "k_sb", "k_sh",
                 "k_sl", "qo_sb", "qo_sh", "qo_sl", "ko_sb", "ko_sh", "ko_sl", "cos_sb", "cos_sl",
                 "sin_sb", "sin_sl"):
        sig[name] = "i32"
    block_d = pow2_at_least(head_dim // 2)
    block_hq, q_tiles = _head_tiles(n_q, block_d)
    block_hk, k_tiles = _head_tiles(n_k, block_d)
    block_t = _pow2_at_most(gpu_tile_elems // (max(block_hq, block_hk) * block_d))
    constexprs = {"BLOCK_T": block_t, "BLOCK_D": block_d, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk,
                  "Q_TILES": q_tiles, "K_TILES": k_tiles, "BACKWARD": backward}
    sig.update({name: "constexpr" for name in constexprs})
    return {"name": f"{'bwd' if backward else 'fwd'} qk={_TRITON_TYPE[qk_dt][1:]} cos={_TRITON_TYPE[cs_dt][1:]} "
                    f"D={head_dim} Hq={n_q} Hk={n_k} BLOCK_T={block_t} w{_num_warps(block_t)}{label}",
            "fn": _rope_qk_kernel, "signature": sig, "constexprs": constexprs, "num_warps": _num_warps(block_t),
            "options": {"enable_fp_fusion": False}}


# Tile budgets the GPU benchmark tries besides GPU_TILE_ELEMS (2 and 4 tokens per program at 12/2
# heads of 128); listed here so those launches are compile-checked for sm_75 as well.
BENCH_GPU_TILE_ELEMS = (2048, 4096)


def sm75_specs():
    """Every GPU launch: the workload's (q/k/cos fp32, 12 q heads, 2 kv heads, head_dim 128,
    GPU_TILE_ELEMS) forward and backward, fp16 q/k with fp16 or fp32 cos/sin, and the benchmark's
    multi-token variants. (The interpreter's big tiles never run on a GPU and are not listed.)"""
    f32, f16 = torch.float32, torch.float16
    for qk_dt, cs_dt in ((f32, f32), (f16, f16), (f16, f32)):
        for backward in (False, True):
            yield _spec(qk_dt, cs_dt, backward, 128, 12, 2, GPU_TILE_ELEMS, "")
    for tile in BENCH_GPU_TILE_ELEMS:
        for backward in (False, True):
            yield _spec(f32, f32, backward, 128, 12, 2, tile, " (benchmark sweep)")
