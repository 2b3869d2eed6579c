"""The LM head's backward (solution/kernels/lm_head_loss.py's fused LM head + cross-entropy):
the hidden states' gradient from the forward's G = fp16((softmax - onehot) * GRAD_SCALE) @ W16,
non-finite exactly where stock's fp16 logit gradient or its fp16 GEMM overflows, so that GradScaler
skips the same optimizer steps as stock at any loss scale (docs/kernels/lm_head_loss.md, 4a). Its
launch configurations for the sm_75 check are in lm_head_loss.sm75_specs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from solution.kernels._launches import cdiv, launch, pow2_at_least

# Where stock's logit gradient / GEMM output in the compute dtype becomes inf: fp16 rounds to nearest
# even, so 65520 (65504 + half an ulp) and beyond give inf; an fp32 value is inf only once it is.
OVERFLOW_LIMIT = {torch.float16: 65520.0, torch.float32: float("inf")}
# Backward kernel (_lm_head_ce_bwd_kernel): one row per program, up to BWD_BLOCK_H hidden columns a
# step, on the GPU; 64 rows per program under the interpreter (it pays per operation).
BWD_BLOCK_H = 2048
BWD_NUM_WARPS = 4


@triton.jit(do_not_specialize=["n_rows"])
def _lm_head_ce_bwd_kernel(scaled_ptr, out_ptr, labels_ptr, stats_ptr, w_ptr, upstream_ptr, n_rows,
                           scaled_stride, out_stride, w_stride, inv_grad_scale, limit, HIDDEN: tl.constexpr,
                           IGNORE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The hidden-state gradient from the forward's G = fp16((p - onehot) * GRAD_SCALE) @ W16
    ([n_rows, HIDDEN], the compute dtype) and the loss sum's upstream gradient c (upstream_ptr: one
    fp32 value on the device, read here so that backward never syncs), written in the hidden
    states' dtype, non-finite exactly where stock's is.

    What it replaces: ``(G.float() * (c / GRAD_SCALE)).to(hidden dtype)`` (two or three torch
    elementwise passes over [n_rows, HIDDEN]), which stays finite where stock's fp16 logit
    gradient or its fp16 GEMM overflows: under a large GradScaler scale GradScaler would then see
    finite gradients and take optimizer steps that stock skips.

    Stock's chain (fp16 autocast; c = GradScaler's scale / num_items_in_batch, fp32):
      nll_loss backward: -c at (r, y_r) on labelled rows, nothing (0) on ignored rows;
      log_softmax backward, fp32: d = g - p * sum(g), i.e. d[r, y] = -c + p_y c, d[r, v] = p_v c
        (v != y) on labelled rows, 0 - p * 0 = 0 on ignored rows (NaN where the row's logits are);
      .float()'s backward: D16 = fp16(d), inf where |d| >= 65520 (round to nearest even);
      F.linear's backward: D16 @ W16 accumulated in fp32, rounded to fp16 (inf where |sum| >= 65520).
    So row r of stock's gradient is:
      (A) labelled, c finite, some |d[r, v]| >= 65520, i.e. |c (p_y - 1)| >= 65520 or c p1 >= 65520
          (p1: the largest non-label p; p1 <= 1 - p_y, so in exact arithmetic (A) is
          c (1 - p_y) >= 65520): every element is sum over the overflowing v of +-inf * W16[v, h]:
          +-inf where those terms agree in sign and no W16[v, h] is 0, else NaN;
      (B) otherwise finite, except the elements where |sum_v D16[r, v] W16[v, h]| >= 65520: +-inf;
      (C) labelled, c = +-inf or NaN: -c + p_y c is NaN, and the GEMM spreads it: all NaN;
      (D) ignored: 0 for any c (NaN where the forward's row already is).
    What this kernel does, per row (a few scalars) and per element:
      out = G * (c * inv_grad_scale) in fp32: the former formula, bit for bit (inv_grad_scale =
        1 / GRAD_SCALE, a power of two, so the product equals c / GRAD_SCALE times G exactly);
      (A) with stats = (p_y, p1, p2, j1) from the forward kernel (the same fp32 p its gradient
          sweep used; j1 = the column of p1), e_y = p_y c - c, e1 = p1 c, e2 = p2 c; if
          |e_y| >= limit or |e1| >= limit, the row becomes sign(e_y) inf * W16[y, h] (if
          |e_y| >= limit) + sign(e1) inf * W16[j1, h] (if |e1| >= limit): stock's element
          classes, +-inf or NaN, whenever at most one non-label entry overflows; when p2
          overflows too (|e2| >= limit) the row is NaN (non-finite like stock's, which may keep
          +-inf in the elements where all its inf terms agree in sign). The two W rows are read
          only for such rows (masked loads), cast to G's dtype as autocast does;
      (B) |out| >= limit: +-inf (the sign of out);
      (C) the labelled rows' multiplier is NaN; (D) the ignored rows' multiplier is 0, so they are
          0 * G = 0 (NaN where G's row is NaN), whatever c.
    limit = 65520 for fp16 compute; +inf for fp32 compute (stock's fp32 logit gradient and GEMM
    overflow only at fp32's own limit, where the fp32 products here overflow as well).
    Risks: at the very edge of the threshold the two paths round differently (our p's in another
    summation order; our G rounds (p - onehot) * 1024 and the GEMM's output to fp16 instead of
    (p - onehot) * c): an |e| within a few fp32 ulps, or a |sum| within ~1e-3 relative, of 65520
    may fall on the other side. cuBLAS's reduced-precision split-K reductions (allowed for fp16 by
    torch's default allow_fp16_reduced_precision_reduction) could overflow in a partial sum
    whose total is finite: not reproduced. A row whose logits hold NaN / +inf has a NaN G row: it
    stays NaN (stock's too) whatever the top-2 says."""
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
    """_lm_head_ce_bwd_kernel on the forward's G (``scaled``, [rows, H] in the compute dtype) and
    per-row results (labels int64 [rows], the row kernel's stats fp32 [rows, 4], in G's row
    order), the head's weight [V, H] (any float dtype: cast to G's dtype in the kernel) and the
    loss sum's upstream gradient (a 0-dim tensor on the device): the hidden-state gradient
    [rows, H] in out_dtype. ``grad_scale``: the forward's GRAD_SCALE; ``ignore_index``: the label of
    ignored rows; ``interpreter_tiles``: (rows, columns) per program under Triton's interpreter,
    None on a GPU."""
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
