"""Fused LM head + causal-LM cross-entropy (+ trl's entropy and argmax), chunked over tokens: per
chunk, logits = h16 @ W16.T (cuBLAS), one Triton row kernel (loss = lse - x[label], entropy,
argmax; in place, the gradient (softmax - onehot) * GRAD_SCALE), G = dlogits @ W16; backward is
lm_head_grad.py's kernel, G * grad_output / GRAD_SCALE. Entry point: ``fused_lm_head_loss(hidden
[..., H], weight [V, H] frozen, shift_labels) -> LMHeadLossOutput``; fp16 / fp32 compute.
What it replaces, why, risks, measurements: docs/kernels/lm_head_loss.md.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from solution.kernels._launches import cdiv, launch, record
from solution.kernels.lm_head_grad import BWD_BLOCK_H, BWD_NUM_WARPS, _lm_head_ce_bwd_kernel, launch_bwd_kernel
from solution.settings import interpreter_enabled

IGNORE_INDEX = -100
# The fp16 gradient buffer holds (softmax - onehot) * GRAD_SCALE; backward divides it out in fp32.
GRAD_SCALE = 1024.0
# GPU: one row per program, 2048 columns a step, 8 warps (16-byte loads); 880 rows a chunk give
# ~22 programs per SM of a T4.
BLOCK_ROWS = 1
BLOCK_V = 2048
NUM_WARPS = 8
# Triton's CPU interpreter pays a fixed cost per tl op per program: big tiles there (never on a GPU).
INTERP_BLOCK_ROWS = 64
INTERP_BLOCK_V = 8192
# Under the interpreter, chunks with more logits than this go to rows_reference_torch (it also pays
# per element: a full chunk would take seconds); smaller ones (every unit test) run the kernel.
# None = always the kernel.
INTERP_KERNEL_MAX_LOGITS: int | None = 1 << 22
# Value loaded for columns past the vocabulary: the most negative finite value of the logits dtype
# (finite, so 0 * (fill - max) is 0, not NaN; exp(fill - max) is exactly 0).
NEG_FILL = {torch.float16: -65504.0, torch.float32: -3.0e38}
# Memory for one chunk of logits (the only [rows, V] buffer alive): 880 rows of V = 151936 fp16.
DEFAULT_CHUNK_BUDGET_BYTES = 256 * 1024 * 1024
# Chunk rows are a multiple of this (tensor-core friendly GEMM shapes).
ROW_ALIGN = 16
SUPPORTED_COMPUTE_DTYPES = (torch.float16, torch.float32)
QWEN2_VOCAB = 151936  # Qwen2.5's vocabulary: the VOCAB the workload compiles the kernel for
QWEN2_HIDDEN = 1536  # Qwen2.5-1.5B's hidden size: the HIDDEN the workload compiles the backward for


@triton.jit(do_not_specialize=["n_rows"])
def _lm_head_ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, entropy_ptr, argmax_ptr, stats_ptr,
                            n_rows, row_stride, grad_scale, VOCAB: tl.constexpr, IGNORE: tl.constexpr,
                            NEG_FILL: tl.constexpr, WRITE_GRAD: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row r of a [n_rows, VOCAB] logits chunk, y = labels[r], in fp32:
        loss[r] = logsumexp(x) - x[y] (0 if y == IGNORE, NaN if out of range); entropy[r] =
        -sum p log p, p = softmax(x), every row; argmax[r] = first index of the max (torch's rule:
        a NaN counts as the max, and so does a +inf before it). If WRITE_GRAD: x[:] = (p -
        onehot(y)) * grad_scale in the logits dtype (0 on ignored rows) and stats[r] = (p_y (NaN if
        y is out of range), p1, p2 = the two largest non-label p, the column of p1), for backward.
    First sweep, read only, with a running max m per row: s = sum exp(x - m), t = sum exp(x - m)
    (x - m), rescaled when m grows; lse = m + log s, entropy = log s - t / s. With WRITE_GRAD it
    reduces over the non-label columns, the label's logit entering as a scalar (the same m and
    argmax), and keeps a running top-2. Second sweep (WRITE_GRAD): the gradient over each block;
    ignored rows are not reread. Columns past VOCAB load NEG_FILL; rows past n_rows (last tile
    only) recompute row n_rows - 1 and store nothing."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # int64: row * stride > 2^31
    row_ok = rows < n_rows
    rows = tl.minimum(rows, n_rows - 1)
    row_ptrs = logits_ptr + rows * row_stride  # [BLOCK_ROWS] pointers to the row starts
    labels = tl.load(labels_ptr + rows).to(tl.int32)
    offs = tl.arange(0, BLOCK_V)
    ignored = labels == IGNORE
    in_range = (labels >= 0) & (labels < VOCAB)
    x_label = tl.load(row_ptrs + tl.where(in_range, labels, 0)).to(tl.float32)  # always a valid address
    label_col = tl.where(in_range, labels, -1)  # the column masked out of the non-label reduction
    label_key = tl.where(x_label == x_label, x_label, float("inf"))  # its reduction key (NaN as +inf)

    m = tl.full([BLOCK_ROWS], -3.0e38, tl.float32)  # finite "minus infinity": 0 * (m_old - m_new) stays finite
    s = tl.zeros([BLOCK_ROWS], tl.float32)
    t = tl.zeros([BLOCK_ROWS], tl.float32)
    best = tl.zeros([BLOCK_ROWS], tl.int32)
    x1 = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)  # WRITE_GRAD: largest non-label logit so far,
    x2 = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)  # the second largest,
    j1 = tl.zeros([BLOCK_ROWS], tl.int32)                   # and the (first) column of the largest
    for start in range(0, VOCAB, BLOCK_V):
        cols = start + offs
        x = tl.load(row_ptrs[:, None] + cols[None, :], mask=(cols < VOCAB)[None, :], other=NEG_FILL)
        x = x.to(tl.float32)
        # NaN enters the max / argmax as +inf (torch.argmax's rule), so tl.max never sees one (its
        # NaN handling differs between GPU and interpreter versions); s still becomes NaN.
        key = tl.where(x == x, x, float("inf"))
        if WRITE_GRAD:
            # the same reduction over the non-label columns, the label's key put back as a scalar:
            # block max = max(non-label max, label key), first index of it as before
            key = tl.where(cols[None, :] == label_col[:, None], float("-inf"), key)
            nl_max, nl_arg = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
            nl_2 = tl.max(tl.where(offs[None, :] == nl_arg[:, None], float("-inf"), key), axis=1)
            here = (label_col >= start) & (label_col < start + BLOCK_V)  # the label's column is in this block
            y_off = label_col - start
            label_wins = here & ((label_key > nl_max) | ((label_key == nl_max) & (y_off < nl_arg)))
            block_max = tl.where(here, tl.maximum(nl_max, label_key), nl_max)
            block_arg = tl.where(label_wins, y_off, nl_arg)
            first = nl_max > x1  # strict: an earlier block keeps the column on a tie
            x2 = tl.where(first, tl.maximum(x1, nl_2), tl.maximum(x2, nl_max))
            j1 = tl.where(first, start + nl_arg, j1)
            x1 = tl.where(first, nl_max, x1)
        else:
            block_max, block_arg = tl.max(key, axis=1, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(block_max > m, start + block_arg, best)  # strict: an earlier block wins ties
        m_new = tl.maximum(m, block_max)
        alpha = tl.exp(m - m_new)
        shifted = x - m_new[:, None]
        e = tl.exp(shifted)
        t = alpha * (t + s * (m - m_new)) + tl.sum(e * shifted, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new

    log_s = tl.log(s)
    lse = m + log_s
    loss = tl.where(ignored, 0.0, tl.where(in_range, lse - x_label, float("nan")))
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    tl.store(entropy_ptr + rows, log_s - t / s, mask=row_ok)
    tl.store(argmax_ptr + rows, best.to(tl.int64), mask=row_ok)

    if WRITE_GRAD:
        labelled = (labels != IGNORE)[:, None]
        for start in range(0, VOCAB, BLOCK_V):
            cols = start + offs
            ptrs = row_ptrs[:, None] + cols[None, :]
            in_row = (cols < VOCAB)[None, :]
            # Ignored rows: the load is masked off (no memory traffic), exp(NEG_FILL - lse) = 0.
            x = tl.load(ptrs, mask=in_row & labelled, other=NEG_FILL).to(tl.float32)
            p = tl.exp(x - lse[:, None])
            grad = tl.where(cols[None, :] == labels[:, None], p - 1.0, p) * grad_scale
            tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=in_row & row_ok[:, None])
        # the gradient sweep's p at the label's column and at the two largest other ones
        tl.store(stats_ptr + rows * 4, tl.where(in_range, tl.exp(x_label - lse), float("nan")), mask=row_ok)
        tl.store(stats_ptr + rows * 4 + 1, tl.exp(x1 - lse), mask=row_ok)
        tl.store(stats_ptr + rows * 4 + 2, tl.exp(x2 - lse), mask=row_ok)
        tl.store(stats_ptr + rows * 4 + 3, j1.to(tl.float32), mask=row_ok)


def plan_chunk_rows(n_rows: int, vocab: int, elem_bytes: int,
                    budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES, row_align: int = ROW_ALIGN) -> int:
    """Rows per chunk: as many as fit the logits budget (a multiple of row_align, at least one
    row_align), then balanced so all chunks are about the same size (no tiny last chunk)."""
    if n_rows <= 0:
        return 1
    max_rows = max(row_align, (budget_bytes // max(1, vocab * elem_bytes)) // row_align * row_align)
    n_chunks = math.ceil(n_rows / max_rows)
    rows = math.ceil(n_rows / n_chunks)
    rows = math.ceil(rows / row_align) * row_align
    return max(1, min(rows, n_rows))


def default_launch_config() -> tuple[int, int, int]:
    """(block_rows, block_v, num_warps): the GPU's, or the interpreter's big tiles."""
    if interpreter_enabled():
        return INTERP_BLOCK_ROWS, INTERP_BLOCK_V, 1
    return BLOCK_ROWS, BLOCK_V, NUM_WARPS


def launch_rows_kernel(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor,
                       entropy: torch.Tensor, argmax: torch.Tensor, write_grad: bool,
                       block_v: int | None = None, num_warps: int | None = None,
                       block_rows: int | None = None, stats: torch.Tensor | None = None) -> None:
    """The row kernel on a [rows, vocab] logits chunk (fp16 / fp32, column stride 1), labels int64
    [rows]: writes loss, entropy fp32 [rows], argmax int64 [rows], and with write_grad the
    gradient in place and stats fp32 [rows, 4] (contiguous; scratch when None). None: the value
    of default_launch_config()."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and labels.dtype == torch.int64 and logits.dtype in NEG_FILL
    if rows == 0:
        return
    if stats is None:
        stats = torch.empty((rows, 4), dtype=torch.float32, device=logits.device)
    assert stats.shape == (rows, 4) and stats.is_contiguous() and stats.dtype == torch.float32 and vocab <= 1 << 24
    d_rows, d_v, d_warps = default_launch_config()
    block_rows, block_v, num_warps = block_rows or d_rows, block_v or d_v, num_warps or d_warps
    grid = (cdiv(rows, block_rows),)
    launch(_lm_head_ce_rows_kernel, grid, "_lm_head_ce_rows_kernel",
           logits, labels, loss, entropy, argmax, stats, rows, logits.stride(0), GRAD_SCALE,
           VOCAB=vocab, IGNORE=IGNORE_INDEX, NEG_FILL=NEG_FILL[logits.dtype],
           WRITE_GRAD=write_grad, BLOCK_ROWS=block_rows, BLOCK_V=block_v,
           num_warps=num_warps)


def rows_reference_torch(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor,
                         entropy: torch.Tensor, argmax: torch.Tensor, write_grad: bool,
                         rows_per_step: int = 64, stats: torch.Tensor | None = None) -> None:
    """What launch_rows_kernel computes, in PyTorch with the kernel's formulas, rows_per_step rows
    at a time: big chunks under the interpreter (INTERP_KERNEL_MAX_LOGITS), an oracle in tests."""
    rows, vocab = logits.shape
    if stats is None:
        stats = torch.empty((rows, 4), dtype=torch.float32, device=logits.device)
    for r0 in range(0, rows, rows_per_step):
        r1 = min(r0 + rows_per_step, rows)
        x = logits[r0:r1].float()  # a copy for fp16 logits, the same storage for fp32 (read before written)
        y = labels[r0:r1]
        m, argmax[r0:r1] = torch.max(x, dim=1)  # torch.max(dim) returns the first index of the max
        shifted = x - m[:, None]
        e = shifted.exp()
        s = e.sum(dim=1)
        t = torch.einsum("ij,ij->i", e, shifted)  # a dot product per row, no temporary
        log_s = s.log()
        lse = m + log_s
        entropy[r0:r1] = log_s - t / s
        in_range = (y >= 0) & (y < vocab)
        ignored = y == IGNORE_INDEX
        safe = torch.where(in_range, y, 0)
        row_loss = torch.where(in_range, lse - x.gather(1, safe[:, None])[:, 0], float("nan"))
        loss[r0:r1] = torch.where(ignored, 0.0, row_loss)
        if write_grad:
            p = (x - lse[:, None]).exp_()  # the kernel's p, for the top-2 of the non-label columns
            at_label = torch.arange(r1 - r0, device=p.device)[in_range], safe[in_range]
            stats[r0:r1, 0] = float("nan")
            stats[r0:r1, 0][in_range] = p[at_label]
            p[at_label] = -1.0
            top = p.topk(min(2, vocab), dim=1)
            stats[r0:r1, 1] = top.values[:, 0]
            stats[r0:r1, 2] = top.values[:, 1] if vocab > 1 else -1.0
            stats[r0:r1, 3] = top.indices[:, 0].to(torch.float32)
            del p, top
            e.mul_((GRAD_SCALE / s)[:, None])  # softmax * GRAD_SCALE
            e[torch.arange(r1 - r0, device=e.device)[in_range], safe[in_range]] -= GRAD_SCALE
            e[ignored] = 0.0
            logits[r0:r1].copy_(e)


def run_rows(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, entropy: torch.Tensor,
             argmax: torch.Tensor, write_grad: bool, block_v: int | None = None,
             block_rows: int | None = None, stats: torch.Tensor | None = None) -> None:
    """launch_rows_kernel, except for chunks above INTERP_KERNEL_MAX_LOGITS under the interpreter
    (counted as "_lm_head_ce_rows_torch" in _launches)."""
    limit = INTERP_KERNEL_MAX_LOGITS
    if interpreter_enabled() and limit is not None and logits.numel() > limit:
        rows_reference_torch(logits, labels, loss, entropy, argmax, write_grad, stats=stats)
        record("_lm_head_ce_rows_torch", ours=False)
    else:
        launch_rows_kernel(logits, labels, loss, entropy, argmax, write_grad, block_v=block_v,
                           block_rows=block_rows, stats=stats)


# The frozen head's last cast to the compute dtype (one entry), reused while the weight is unchanged
# (the rule and its risk: docs/kernels/lm_head_loss.md, section 4).
_WEIGHT_CACHE: dict = {}


def _weight_key(weight: torch.Tensor, dtype: torch.dtype):
    return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), weight.dtype, dtype,
            weight.device)


def cast_frozen_weight(weight: torch.Tensor, dtype: torch.dtype, cache: bool = True) -> torch.Tensor:
    """``weight.to(dtype)``: the same values, reused across calls for a frozen weight when ``cache``
    (never for a weight that requires grad); cache=False casts every call."""
    if weight.dtype == dtype or weight.requires_grad or not cache:
        return weight.to(dtype)
    key = _weight_key(weight, dtype)
    hit = _WEIGHT_CACHE.get("entry")
    if hit is not None and hit[0]() is weight and hit[1] == key:
        return hit[2]
    _WEIGHT_CACHE.clear()  # drop the old copy before making the new one
    cast = weight.to(dtype)
    # a weak reference: the very same tensor object (a new weight at a freed one's address is a miss)
    _WEIGHT_CACHE["entry"] = (weakref.ref(weight), key, cast)
    return cast


def clear_weight_cache() -> None:
    _WEIGHT_CACHE.clear()


def _forward_chunks(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor,
                    compute_dtype: torch.dtype, want_grad: bool, chunk_rows: int | None,
                    block_v: int | None, block_rows: int | None, cache_weight: bool = True,
                    grad_rows: int | None = None):
    """The chunk loop (no autograd). grad_rows: only rows [0, grad_rows) can have a label (put first):
    the hidden-state gradient is [grad_rows, H] (zero elsewhere). None: every row."""
    n_rows, _ = hidden2d.shape
    grad_rows = n_rows if grad_rows is None else grad_rows
    vocab = weight.shape[0]
    device = hidden2d.device
    # Exactly the operands autocast would hand to cuBLAS (round-to-nearest casts).
    w_c = cast_frozen_weight(weight, compute_dtype, cache_weight)  # [V, H]; 467 MB for the fp32 Qwen2.5 head
    h_c = hidden2d.to(compute_dtype)
    labels1d = labels1d.to(device=device, dtype=torch.int64)

    token_loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=device)
    argmax = torch.empty(n_rows, dtype=torch.int64, device=device)
    stats = torch.empty((n_rows, 4), dtype=torch.float32, device=device)  # backward's overflow check
    grad_hidden = torch.empty((grad_rows, hidden2d.shape[1]), dtype=compute_dtype, device=device) if want_grad else None

    if chunk_rows is None:
        # Chunks a multiple of the kernel's row tile (only > ROW_ALIGN in the interpreter), so
        # only the very last tile can be partial.
        row_align = max(ROW_ALIGN, block_rows or default_launch_config()[0])
        chunk_rows = plan_chunk_rows(n_rows, vocab, torch.finfo(compute_dtype).bits // 8, row_align=row_align)
    chunk_rows = max(1, min(chunk_rows, max(n_rows, 1)))
    buf = torch.empty((chunk_rows, vocab), dtype=compute_dtype, device=device)
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(r0 + chunk_rows, n_rows)
        logits = buf[: r1 - r0]  # a contiguous prefix of the reused buffer
        torch.mm(h_c[r0:r1], w_c.t(), out=logits)
        run_rows(logits, labels1d[r0:r1], token_loss[r0:r1], entropy[r0:r1], argmax[r0:r1],
                 write_grad=want_grad, block_v=block_v, block_rows=block_rows, stats=stats[r0:r1])
        if want_grad and r0 < grad_rows:
            # logits now holds (softmax - onehot) * GRAD_SCALE: the hidden-state gradient, scaled
            # (zero on rows without a label: those past grad_rows are not multiplied at all).
            g1 = min(r1, grad_rows)
            torch.mm(logits[: g1 - r0], w_c, out=grad_hidden[r0:g1])
    return token_loss, entropy, argmax, grad_hidden, stats


class _FusedLMHeadCE(torch.autograd.Function):
    """(hidden [N, H], weight [V, H] frozen, shift_labels [N]) -> (loss_sum fp32 scalar,
    entropy fp32 [N], argmax int64 [N], token_loss fp32 [N]); only loss_sum is differentiable
    (w.r.t. hidden)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, labels1d, compute_dtype, chunk_rows, block_v, block_rows, want_grad,
                cache_weight, labelled_rows=None):
        order = None
        labels1d = labels1d.to(device=hidden2d.device, dtype=torch.int64)
        if want_grad and labelled_rows is not None and labelled_rows < hidden2d.shape[0]:
            # rows with a label first (stable: each group in its own order), so that the gradient
            # GEMM runs on them only; every per-row result is put back in place below
            order = torch.argsort((labels1d == IGNORE_INDEX).to(torch.int8), stable=True)
            hidden_in, labels_in = hidden2d.index_select(0, order), labels1d.index_select(0, order)
        else:
            hidden_in, labels_in, labelled_rows = hidden2d, labels1d, None
        with torch.autocast(hidden2d.device.type, enabled=False):
            token_loss, entropy, argmax, grad_hidden, stats = _forward_chunks(
                hidden_in, weight, labels_in, compute_dtype, want_grad, chunk_rows, block_v, block_rows, cache_weight,
                grad_rows=labelled_rows)
        if order is not None:
            token_loss, entropy, argmax, stats = (torch.empty_like(t).index_copy_(0, order, t)
                                                  for t in (token_loss, entropy, argmax, stats))
            full = torch.zeros((hidden2d.shape[0], grad_hidden.shape[1]), dtype=grad_hidden.dtype, device=grad_hidden.device)
            grad_hidden = full.index_copy_(0, order[:labelled_rows], grad_hidden)
        loss_sum = token_loss.sum()  # in the rows' own order, as without the reordering
        ctx.hidden_dtype = hidden2d.dtype
        ctx.has_grad = grad_hidden is not None
        if ctx.has_grad:
            # G, and what backward needs to overflow where stock does (16 bytes a row; W is read
            # only on rows that overflow)
            ctx.save_for_backward(grad_hidden, labels1d, stats, weight)
        ctx.mark_non_differentiable(entropy, argmax, token_loss)
        return loss_sum, entropy, argmax, token_loss

    @staticmethod
    def backward(ctx, grad_loss_sum, _grad_entropy, _grad_argmax, _grad_token_loss):
        if not ctx.has_grad:
            raise RuntimeError("fused_lm_head_loss: forward ran without gradient bookkeeping "
                               "(want_grad=False) but a gradient was requested")
        scaled, labels1d, stats, weight = ctx.saved_tensors
        # grad_loss_sum carries the GradScaler factor and 1 / num_items_in_batch: applied in fp32,
        # with stock's overflows (inf / NaN rows and elements) reproduced, in one launch.
        grad_hidden = launch_bwd_kernel(scaled, labels1d, stats, weight, grad_loss_sum, ctx.hidden_dtype,
                                        grad_scale=GRAD_SCALE, ignore_index=IGNORE_INDEX,
                                        interpreter_tiles=(INTERP_BLOCK_ROWS, INTERP_BLOCK_V) if interpreter_enabled()
                                        else None)
        return grad_hidden, None, None, None, None, None, None, None, None, None


@dataclass
class LMHeadLossOutput:
    """loss: fp32 scalar, normalized like transformers' ForCausalLMLoss (sum / num_items_in_batch,
    or mean over non-ignored tokens when num_items_in_batch is None).
    token_loss: fp32 [...] cross-entropy of each position against its (shifted) label, 0.0 where
    the label is -100 (NaN where it is out of range): loss = token_loss.sum() / divisor.
    token_entropy: fp32 [...] entropy (nats) of softmax(logits) at every position (what trl's
    entropy_from_logits returns). token_argmax: int64 [...] argmax of the logits at every position."""
    loss: torch.Tensor
    token_loss: torch.Tensor
    token_entropy: torch.Tensor
    token_argmax: torch.Tensor


def shift_labels_like_stock(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """ForCausalLMLoss's shift: position i is scored against labels[i + 1]; the last position of each
    row gets ignore_index."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def fused_lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, *,
                       compute_dtype: torch.dtype | None = None,
                       num_items_in_batch: torch.Tensor | int | None = None,
                       chunk_rows: int | None = None, block_v: int | None = None,
                       block_rows: int | None = None, cache_weight: bool = True,
                       labelled_rows: int | None = None) -> LMHeadLossOutput:
    """LM head + causal-LM cross-entropy without materializing the [tokens, vocab] logits.
    hidden: [..., H] (fp32 or fp16; requires_grad decides whether the gradient is prepared).
    weight: [V, H] lm_head weight (frozen: no gradient is computed for it).
    shift_labels: [...] int, already shifted (see shift_labels_like_stock), -100 = ignored.
    compute_dtype: dtype of the matmul operands and logits (fp16 = what fp16 autocast does; fp32);
        default: the autocast dtype if autocast is on for hidden's device, else hidden.dtype.
    num_items_in_batch: divisor of the summed loss (the Trainer's count), None = mean.
    chunk_rows / block_v / block_rows: tuning overrides (None = plan_chunk_rows /
        default_launch_config()); the results do not depend on them beyond summation order.
    cache_weight: keep the weight's compute_dtype copy between calls (cast_frozen_weight); same
        values either way.
    labelled_rows: the exact number of tokens whose shift label is not ignored (a host int), when
        known: the gradient GEMM then runs on those rows only, moved first (the same results up to
        the GEMMs' rounding). None: every row in its place.
    Returns LMHeadLossOutput (see there); loss backpropagates into hidden.
    """
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    if compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
        raise ValueError(f"fused_lm_head_loss supports fp16/fp32 compute, got {compute_dtype}")
    lead_shape = hidden.shape[:-1]
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    labels1d = shift_labels.reshape(-1)
    if labels1d.numel() != hidden2d.shape[0]:
        raise ValueError(f"shift_labels has {labels1d.numel()} tokens, hidden has {hidden2d.shape[0]}")
    want_grad = torch.is_grad_enabled() and hidden.requires_grad
    loss_sum, entropy, argmax, token_loss = _FusedLMHeadCE.apply(
        hidden2d, weight, labels1d, compute_dtype, chunk_rows, block_v, block_rows, want_grad, cache_weight,
        labelled_rows)
    # Same normalization as transformers' fixed_cross_entropy.
    if num_items_in_batch is None:
        loss = loss_sum / (labels1d.to(loss_sum.device) != IGNORE_INDEX).sum()
    else:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss_sum.device)
        loss = loss_sum / num_items_in_batch
    return LMHeadLossOutput(loss=loss, token_loss=token_loss.view(lead_shape),
                            token_entropy=entropy.view(lead_shape), token_argmax=argmax.view(lead_shape))


def sm75_specs():
    """Every GPU launch configuration: the row kernel for fp16 / fp32 logits, with and without the
    gradient; the backward kernel for fp16 / fp32 G at Qwen2.5-1.5B's hidden size."""
    for dtype, torch_dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        for write_grad in (True, False):
            yield {
                "name": f"lm_head_ce_rows {dtype} grad={int(write_grad)} R{BLOCK_ROWS} B{BLOCK_V} w{NUM_WARPS}",
                "fn": _lm_head_ce_rows_kernel,
                "signature": {"logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "loss_ptr": "*fp32",
                              "entropy_ptr": "*fp32", "argmax_ptr": "*i64", "stats_ptr": "*fp32",
                              "n_rows": "i32", "row_stride": "i32",
                              "grad_scale": "fp32", "VOCAB": "constexpr", "IGNORE": "constexpr",
                              "NEG_FILL": "constexpr", "WRITE_GRAD": "constexpr", "BLOCK_ROWS": "constexpr",
                              "BLOCK_V": "constexpr"},
                "constexprs": {"VOCAB": QWEN2_VOCAB, "IGNORE": IGNORE_INDEX, "NEG_FILL": NEG_FILL[torch_dtype],
                               "WRITE_GRAD": write_grad, "BLOCK_ROWS": BLOCK_ROWS, "BLOCK_V": BLOCK_V},
                "num_warps": NUM_WARPS,
            }
    for dtype in ("fp16", "fp32"):
        yield {
            "name": f"lm_head_ce_bwd {dtype} R1 H{BWD_BLOCK_H} w{BWD_NUM_WARPS}",
            "fn": _lm_head_ce_bwd_kernel,
            "signature": {"scaled_ptr": f"*{dtype}", "out_ptr": "*fp32", "labels_ptr": "*i64", "stats_ptr": "*fp32",
                          "w_ptr": "*fp32", "upstream_ptr": "*fp32", "n_rows": "i32",
                          "scaled_stride": "i32", "out_stride": "i32", "w_stride": "i32",
                          "inv_grad_scale": "fp32", "limit": "fp32", "HIDDEN": "constexpr", "IGNORE": "constexpr",
                          "BLOCK_ROWS": "constexpr", "BLOCK_H": "constexpr"},
            "constexprs": {"HIDDEN": QWEN2_HIDDEN, "IGNORE": IGNORE_INDEX, "BLOCK_ROWS": 1, "BLOCK_H": BWD_BLOCK_H},
            "num_warps": BWD_NUM_WARPS,
        }
