"""The LM head's backward (for lm_head_loss.py): the hidden states' gradient from the forward's
G = fp16((softmax - onehot) * GRAD_SCALE) @ W16, non-finite exactly where stock's fp16 logit
gradient or its fp16 GEMM overflows (GradScaler skips the same steps). Entry point:
``launch_bwd_kernel``; its sm_75 configurations are in lm_head_loss.sm75_specs.
What it replaces, why, risks, measurements: docs/kernels/lm_head_loss.md (section 4a).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels._launches import cdiv, launch, pow2_at_least

# Where stock's logit gradient / GEMM output in the compute dtype becomes inf: fp16 rounds to nearest
# even, so 65520 (65504 + half an ulp) and beyond give inf; an fp32 value is inf only once it is.
OVERFLOW_LIMIT = {torch.float16: 65520.0, torch.float32: float("inf")}
# GPU: one row per program, up to BWD_BLOCK_H hidden columns a step.
BWD_BLOCK_H = 2048
BWD_NUM_WARPS = 4


@triton.jit(do_not_specialize=["n_rows"])
def _lm_head_ce_bwd_kernel(scaled_ptr, out_ptr, labels_ptr, stats_ptr, w_ptr, upstream_ptr, n_rows,
                           scaled_stride, out_stride, w_stride, inv_grad_scale, limit, HIDDEN: tl.constexpr,
                           IGNORE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The hidden-state gradient, in out's dtype, from G ([n_rows, HIDDEN], the compute dtype), the
    row kernel's stats (p_y, p1, p2, j1) and the loss sum's upstream gradient c (one fp32 value on
    the device: no sync): out = G * (c * inv_grad_scale) in fp32, then, as stock: (A) a labelled row
    where |p_y c - c| or |p1 c| >= limit becomes the +-inf * W16[y / j1, h] terms (NaN if |p2 c|
    >= limit too); (B) |out| >= limit: +-inf; (C) an inf / NaN c: labelled rows NaN; (D) ignored
    rows 0. limit: 65520 for fp16 G, inf for fp32. Derivation: docs/kernels/lm_head_loss.md, 4a."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)
    c = tl.zeros([BLOCK_ROWS], tl.float32) + tl.load(upstream_ptr).to(tl.float32)  # one per row: plain vector ops
    labels = tl.load(labels_ptr + rows)
    labelled = labels != IGNORE
    c_finite = tl.abs(c) < float("inf")  # False for NaN too
    mult = tl.where(labelled, tl.where(c_finite, c * inv_grad_scale, float("nan")), 0.0)
    live = labelled & c_finite
    c_live = tl.where(live, c, 0.0)  # the entries below only matter on live rows (and stay finite elsewhere)
    p_y = tl.load(stats_ptr + rows * 4)
    e_y = p_y * c_live - c_live  # stock's label entry (-c + p_y c); NaN for an out-of-range label: no overflow
    e_1 = tl.load(stats_ptr + rows * 4 + 1) * c_live
    e_2 = tl.load(stats_ptr + rows * 4 + 2) * c_live
    over_y = live & (tl.abs(e_y) >= limit)
    over_1 = live & (tl.abs(e_1) >= limit)
    over_row = over_y | over_1
    over_many = live & (tl.abs(e_2) >= limit)
    inf_y = tl.where(e_y > 0, float("inf"), float("-inf"))
    inf_1 = tl.where(e_1 > 0, float("inf"), float("-inf"))
    w_y = w_ptr + tl.where(labelled, labels, 0) * w_stride  # [BLOCK_ROWS] row starts in W
    w_1 = w_ptr + tl.load(stats_ptr + rows * 4 + 3).to(tl.int64) * w_stride
    offs = tl.arange(0, BLOCK_H)
    for start in range(0, HIDDEN, BLOCK_H):
        cols = start + offs
        m2 = row_ok[:, None] & (cols < HIDDEN)[None, :]
        g = tl.load(scaled_ptr + rows[:, None] * scaled_stride + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        out = g * mult[:, None]
        out = tl.where(tl.abs(out) >= limit, tl.where(out > 0, float("inf"), float("-inf")), out)  # (B)
        # (A): only rows that overflow read W (the masks are off elsewhere: no memory traffic)
        wy = tl.load(w_y[:, None] + cols[None, :], mask=m2 & over_y[:, None], other=0.0)
        w1 = tl.load(w_1[:, None] + cols[None, :], mask=m2 & over_1[:, None], other=0.0)
        wy = wy.to(scaled_ptr.dtype.element_ty).to(tl.float32)
        w1 = w1.to(scaled_ptr.dtype.element_ty).to(tl.float32)
        # +-inf * w by selection (inf * 0 and inf * NaN are NaN), without multiplying by the masked zeros
        term_y = tl.where(wy > 0, inf_y[:, None], tl.where(wy < 0, -inf_y[:, None], float("nan")))
        term_1 = tl.where(w1 > 0, inf_1[:, None], tl.where(w1 < 0, -inf_1[:, None], float("nan")))
        inf_terms = (tl.where(over_y[:, None], term_y, 0.0) + tl.where(over_1[:, None], term_1, 0.0)
                     + tl.where(tl.abs(g) < float("inf"), 0.0, float("nan")))  # a NaN G row stays NaN
        inf_terms = tl.where(over_many[:, None], float("nan"), inf_terms)
        out = tl.where(over_row[:, None], inf_terms, out)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m2)


def launch_bwd_kernel(scaled: torch.Tensor, labels: torch.Tensor, stats: torch.Tensor, weight: torch.Tensor,
                      upstream: torch.Tensor, out_dtype: torch.dtype, *, grad_scale: float, ignore_index: int,
                      interpreter_tiles: tuple[int, int] | None) -> torch.Tensor:
    """The hidden-state gradient [rows, H] in out_dtype from G (``scaled``, [rows, H], compute dtype),
    labels int64 [rows] and stats fp32 [rows, 4] (in G's row order), the head's weight [V, H] (any
    float dtype) and the upstream gradient (0-dim, on the device). ``interpreter_tiles``: (rows,
    columns) per program under Triton's interpreter, None on a GPU."""
    rows, hidden = scaled.shape
    out = torch.empty((rows, hidden), dtype=out_dtype, device=scaled.device)
    if rows == 0:
        return out
    assert scaled.stride(1) == 1 and weight.stride(1) == 1 and stats.is_contiguous()
    upstream = upstream.detach().to(device=scaled.device, dtype=torch.float32).reshape(1)
    if interpreter_tiles is not None:
        block_rows, block_h, num_warps = interpreter_tiles[0], min(pow2_at_least(hidden), interpreter_tiles[1]), 1
    else:
        block_rows, block_h, num_warps = 1, min(pow2_at_least(hidden), BWD_BLOCK_H), BWD_NUM_WARPS
    launch(_lm_head_ce_bwd_kernel, (cdiv(rows, block_rows),), "_lm_head_ce_bwd_kernel",
           scaled, out, labels, stats, weight, upstream, rows,
           scaled.stride(0), out.stride(0), weight.stride(0), 1.0 / grad_scale, OVERFLOW_LIMIT[scaled.dtype],
           HIDDEN=hidden, IGNORE=ignore_index, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps)
    return out
