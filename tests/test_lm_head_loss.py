"""Fused LM head + cross-entropy (solution/kernels/lm_head_loss.py) and its wiring
(solution/patches/qwen2_lm_head_loss.py).

Compared with: an fp64 reference (exact math), stock transformers' ForCausalLMLoss on the stock
logits (F.linear, fp16 operands when fp16), per-token F.cross_entropy, trl's entropy_from_logits and
trl's argmax accuracy; loss value, per-token loss and the hidden-state gradient; ignored (-100) rows,
all-ignored batches, one-token rows, large (fp16-range) logits, argmax ties inside and across vocab
blocks, vocab not a multiple of the block, non-contiguous inputs, the GradScaler factor, no-grad
mode; the GPU tile (1 row per program), the interpreter's multi-row tiles with a partial last tile,
and the PyTorch route big chunks take under the interpreter. Then the patch: a tiny Qwen2 (direct
forward), a real trl SFTTrainer run with / without the patch comparing every logged metric, and
Soup's rewind recorder (its SFTTrainer subclass) comparing the recorded per-row losses.

Tolerances (relative L2 error, tests.conftest.rel_err, unless said otherwise):
  * fp32 compute: loss, entropy 1e-5 and gradient 1e-5 against stock. Same fp32 logits (the same
    torch matmul), fp32 softmax math in another summation order (~1e-7 per element).
  * fp16 compute (what fp16 autocast does), against stock: the logits are the same fp16 matmul, so
    loss and entropy (fp32 math on identical fp16 values) agree to 1e-5. The gradient: stock
    rounds (softmax - onehot) * grad / n to fp16, we round (softmax - onehot) * 1024 to fp16, and
    both round the [rows, H] product to fp16; each rounding errs by at most U16 = 2^-11 ~ 4.9e-4
    relative, so each side is within 2 U16 of the exact product of the same logits and the two
    within GRAD16_TOL = 4 U16 = 1.95e-3 of each other. Against fp64 (where the logits' own fp16
    rounding moves the softmax too) ours must be no less accurate than stock: loss within
    1.25 x stock's error + 1e-5, gradient within 1.5 x stock's error + 1e-5 (see ``K_LOSS``).
  * argmax: identical (same logits values, same first-max tie rule).
  * per-token loss: fp32 math on the same logits as stock's cross_entropy: 1e-5 (fp32 and fp16).
"""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from solution.kernels import _launches
from solution.kernels import lm_head_loss as lm_mod
from solution.kernels.lm_head_loss import (IGNORE_INDEX, fused_lm_head_loss, plan_chunk_rows,
                                           shift_labels_like_stock)
from tests.conftest import rel_err

loss_utils = pytest.importorskip("transformers.loss.loss_utils")
trl_utils = pytest.importorskip("trl.trainer.utils")
ForCausalLMLoss = loss_utils.ForCausalLMLoss
entropy_from_logits = trl_utils.entropy_from_logits

F16, F32 = torch.float16, torch.float32
SMALL_BLOCK = 256  # interpreter tests: several blocks per row, vocab 1000 leaves a ragged tail


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def make_inputs(b, seq, hidden, vocab, device, ignore_frac=0.3, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, seq, hidden, generator=g).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * scale).to(device)
    labels = torch.randint(0, vocab, (b, seq), generator=g)
    labels[torch.rand(b, seq, generator=g) < ignore_frac] = IGNORE_INDEX
    return h, w, labels.to(device)


def stock(h, w, labels, compute_dtype, num_items=None, grad_out=1.0, with_token_loss=True):
    """Stock path: logits = F.linear in compute_dtype (what autocast does), ForCausalLMLoss, trl's
    entropy on the fp32 logits (accelerate converts outputs to fp32), trl's argmax accuracy, and
    (with_token_loss) the per-token cross-entropy Soup's rewind recorder computes from the logits."""
    h = h.detach().requires_grad_(True)
    logits = F.linear(h.to(compute_dtype), w.to(compute_dtype))
    loss = ForCausalLMLoss(logits, labels, w.shape[0], num_items_in_batch=num_items)
    (loss * grad_out).backward()
    with torch.no_grad():
        logits32 = logits.float()
        shift = shift_labels_like_stock(labels)
        token_loss = F.cross_entropy(logits32.reshape(-1, w.shape[0]), shift.reshape(-1), reduction="none",
                                     ignore_index=IGNORE_INDEX).view(shift.shape) if with_token_loss else None
        entropy = entropy_from_logits(logits32)
        preds = logits32[..., :-1, :].contiguous().argmax(dim=-1)
        shift = labels[..., 1:]
        mask = shift != IGNORE_INDEX
        correct = ((preds == shift) & mask).sum()
    return dict(loss=loss.detach(), grad=h.grad, entropy=entropy, argmax=logits32.argmax(-1),
                correct=correct, total=mask.sum(), token_loss=token_loss)


def ours(h, w, labels, compute_dtype, num_items=None, grad_out=1.0, **kw):
    h = h.detach().requires_grad_(True)
    res = fused_lm_head_loss(h, w, shift_labels_like_stock(labels), compute_dtype=compute_dtype,
                             num_items_in_batch=num_items, **kw)
    (res.loss * grad_out).backward()
    shift = shift_labels_like_stock(labels)
    valid = shift != IGNORE_INDEX  # trl's accuracy from our argmax, as the patch computes it
    correct = ((res.token_argmax == shift) & valid).sum()
    return dict(loss=res.loss.detach(), grad=h.grad, entropy=res.token_entropy, argmax=res.token_argmax,
                correct=correct, total=valid.sum(), token_loss=res.token_loss, res=res)


def ref_fp64(h, w, labels, num_items=None):
    """Exact math in fp64: loss and d(loss)/d(hidden)."""
    h64 = h.detach().double().requires_grad_(True)
    logits = h64 @ w.double().t()
    shift = shift_labels_like_stock(labels)
    per_row = F.cross_entropy(logits.reshape(-1, w.shape[0]), shift.reshape(-1), ignore_index=IGNORE_INDEX,
                              reduction="sum")
    n = (shift != IGNORE_INDEX).sum() if num_items is None else num_items
    loss = per_row / n
    loss.backward()
    return loss.detach(), h64.grad


U16 = 2.0 ** -11  # fp16 unit roundoff: one rounding's largest relative error
GRAD16_TOL = 4 * U16  # ours and stock each round the gradient twice in fp16 (module docstring)
# Against fp64, ours no worse than K x stock's own error + FLOOR (fp16 compute). The loss: the same
# fp16 logits and fp32 math, another summation order, so the same error up to ~1e-7: 1.25 leaves a
# quarter for it. The gradient: as many fp16 roundings as stock but other ones (module docstring),
# errors of the same size, not the same values: 1.5. FLOOR 1e-5: the fp32 agreement with stock.
K_LOSS, K_GRAD, FLOOR = 1.25, 1.5, 1e-5


def assert_close_to_stock(a, s, compute_dtype, grad_tol=None):
    grad_tol = grad_tol or (GRAD16_TOL if compute_dtype == F16 else 1e-5)
    loose = compute_dtype == F16 and a["loss"].is_cuda
    # On the GPU cuBLAS may pick another algorithm for a chunk of rows than for the whole matrix
    # and flip the fp16 rounding of a few logits by one ulp (~1e-3 at |logit| ~ 4): a loss / entropy
    # difference up to ~1e-4 and, on a near-tie, another argmax. On the CPU the values are identical.
    val_tol = 1e-4 if loose else 1e-5
    assert rel_err(a["loss"], s["loss"]) < val_tol, (a["loss"], s["loss"])
    assert rel_err(a["entropy"], s["entropy"]) < val_tol
    assert rel_err(a["token_loss"], s["token_loss"]) < val_tol
    assert a["token_loss"].dtype == F32 and a["token_loss"].shape == s["token_loss"].shape
    mismatches = int((a["argmax"].cpu() != s["argmax"].cpu()).sum())
    assert mismatches <= (max(1, a["argmax"].numel() // 1000) if loose else 0), mismatches
    assert abs(int(a["correct"]) - int(s["correct"])) <= mismatches and int(a["total"]) == int(s["total"])
    assert rel_err(a["grad"], s["grad"]) < grad_tol, rel_err(a["grad"], s["grad"])


# --------------------------------------------------------------------------------------------------
# kernel vs stock / fp64 (CPU interpreter or GPU)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compute_dtype", [F32, F16])
@pytest.mark.parametrize("vocab", [1000, 1024])  # ragged tail / exact multiple of the block
@pytest.mark.parametrize("block_rows", [None, 1, 4])  # default (GPU: 1 row, interpreter: 64) / GPU tile / partial tile
def test_matches_stock_and_fp64(device, compute_dtype, vocab, block_rows):
    h, w, labels = make_inputs(1, 37, 64, vocab, device)
    _launches.reset()
    # 3 chunks of 16 / 16 / 5 rows; with 4-row tiles the 5-row chunk ends in a partial tile
    a = ours(h, w, labels, compute_dtype, num_items=30, chunk_rows=16, block_v=SMALL_BLOCK, block_rows=block_rows)
    assert _launches.LAUNCHES["_lm_head_ce_rows_kernel"] == 3
    s = stock(h, w, labels, compute_dtype, num_items=30)
    assert_close_to_stock(a, s, compute_dtype)
    loss64, grad64 = ref_fp64(h, w, labels, num_items=30)
    if compute_dtype == F16:
        assert rel_err(a["loss"], loss64) <= K_LOSS * rel_err(s["loss"], loss64) + FLOOR
        assert rel_err(a["grad"], grad64) <= K_GRAD * rel_err(s["grad"], grad64) + FLOOR
    else:
        assert rel_err(a["loss"], loss64) < 1e-5 and rel_err(a["grad"], grad64) < 1e-5
    assert a["loss"].dtype == F32 and a["loss"].dim() == 0 and a["grad"].dtype == h.dtype


def test_mean_reduction_batch_and_noncontiguous(device):
    """num_items_in_batch=None (mean over non-ignored), batch > 1, a non-contiguous hidden view."""
    h, w, labels = make_inputs(3, 9, 48, 1000, device, seed=1)
    h_nc = h.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous strides
    assert not h_nc.is_contiguous()
    a = ours(h_nc, w, labels, F32, block_v=SMALL_BLOCK)
    s = stock(h, w, labels, F32)
    assert_close_to_stock(a, s, F32)


def test_grad_scaler_factor_is_exact(device):
    """The upstream gradient (GradScaler's 65536 / num_items) multiplies the stored gradient in fp32:
    scaling the upstream gradient by a power of two scales our gradient exactly."""
    h, w, labels = make_inputs(1, 21, 32, 1000, device, seed=2)
    g1 = ours(h, w, labels, F16, num_items=17, grad_out=1.0, block_v=SMALL_BLOCK)["grad"]
    g2 = ours(h, w, labels, F16, num_items=17, grad_out=65536.0, block_v=SMALL_BLOCK)["grad"]
    assert torch.equal(g2, g1 * 65536.0)
    s = stock(h, w, labels, F16, num_items=17, grad_out=65536.0)
    assert rel_err(g2, s["grad"]) < GRAD16_TOL


@pytest.mark.parametrize("compute_dtype,hidden_dtype", [(F16, F32), (F16, F16), (F32, F32)])
def test_finite_results_bit_for_bit(device, compute_dtype, hidden_dtype):
    """Where nothing overflows, the overflow bookkeeping changes no bit: the forward's per-token
    results are those of the kernel without gradient (no row_p / top-2 work), and backward's
    gradient is exactly (G.float() * (grad_output / GRAD_SCALE)).to(hidden dtype) on the forward's
    G (the formula before the overflow check), for loss scales up to 2**16 and a negative one;
    the reordered labelled-rows path (labelled_rows) gives its own plain formula's bits too."""
    h, w, labels = make_inputs(2, 19, 48, 1000, device, seed=11)
    h = h.to(hidden_dtype)
    shift = shift_labels_like_stock(labels).reshape(-1)
    n_lab = int((shift != IGNORE_INDEX).sum())
    kw = dict(chunk_rows=16, block_v=SMALL_BLOCK, block_rows=None, cache_weight=False)
    h2 = h.reshape(-1, 48)
    with torch.no_grad():
        ref = lm_mod._forward_chunks(h2, w, shift, compute_dtype, False, **kw)
        fwd = lm_mod._forward_chunks(h2, w, shift, compute_dtype, True, **kw)
    for i, name in enumerate(("token_loss", "entropy", "argmax")):
        assert torch.equal(fwd[i], ref[i]), name
    G = fwd[3]
    for labelled_rows in (None, n_lab):
        for up in (1.0, 3.0, 65536.0, -20.0):
            hd = h.detach().requires_grad_(True)
            res = fused_lm_head_loss(hd, w, shift.view(2, 19), compute_dtype=compute_dtype, num_items_in_batch=17,
                                     chunk_rows=16, block_v=SMALL_BLOCK, cache_weight=False,
                                     labelled_rows=labelled_rows)
            (res.loss * up).backward()
            assert torch.equal(res.token_loss.reshape(-1), ref[0]) or labelled_rows is not None
            c = torch.tensor(up, dtype=torch.float32, device=device) / 17  # autograd's grad of loss_sum
            if labelled_rows is None:
                expect = (G.float() * (c / lm_mod.GRAD_SCALE)).to(hidden_dtype).view(2, 19, 48)
            else:  # G of the reordered run, by the same formula
                order = torch.argsort((shift == IGNORE_INDEX).to(torch.int8), stable=True)
                with torch.no_grad():
                    g_first = lm_mod._forward_chunks(h2.index_select(0, order), w, shift.index_select(0, order),
                                                     compute_dtype, True, grad_rows=n_lab, **kw)[3]
                full = torch.zeros_like(G).index_copy_(0, order[:n_lab], g_first)
                expect = (full.float() * (c / lm_mod.GRAD_SCALE)).to(hidden_dtype).view(2, 19, 48)
            assert hd.grad.dtype == hidden_dtype and torch.isfinite(hd.grad).all()
            assert torch.equal(hd.grad, expect), (labelled_rows, up)


def test_ignored_rows_and_one_token_rows(device):
    """A row of all -100, one-token rows (no target at all after the shift), and an all-ignored batch."""
    h, w, labels = make_inputs(3, 8, 32, 1000, device, seed=3)
    labels[1] = IGNORE_INDEX
    a = ours(h, w, labels, F16, num_items=int((labels[..., 1:] != IGNORE_INDEX).sum()), block_v=SMALL_BLOCK)
    s = stock(h, w, labels, F16, num_items=int((labels[..., 1:] != IGNORE_INDEX).sum()))
    assert_close_to_stock(a, s, F16)
    assert torch.count_nonzero(a["grad"][1]) == 0  # an all-ignored row gets no gradient
    assert torch.count_nonzero(a["grad"][:, -1]) == 0  # nor does the last position (its target is padding)
    # per-token loss: exactly 0 where the shifted label is -100 (a whole row, every last position)
    shift = shift_labels_like_stock(labels)
    assert torch.count_nonzero(a["token_loss"][shift == IGNORE_INDEX]) == 0
    assert (a["token_loss"][shift != IGNORE_INDEX] > 0).all()
    assert rel_err(a["token_loss"].sum() / int((shift != IGNORE_INDEX).sum()), a["loss"]) < 1e-6

    # one-token rows: the shift leaves nothing to predict; with the Trainer's count (0 -> we pass 1
    # as a safe divisor, like a batch whose other micro-batches hold the labels) loss and grad are 0
    h1, w1, labels1 = make_inputs(4, 1, 32, 1000, device, ignore_frac=0.0, seed=4)
    a1 = ours(h1, w1, labels1, F16, num_items=1, block_v=SMALL_BLOCK)
    s1 = stock(h1, w1, labels1, F16, num_items=1)
    assert a1["loss"].item() == 0.0 and s1["loss"].item() == 0.0
    assert torch.count_nonzero(a1["grad"]) == 0 and torch.count_nonzero(s1["grad"]) == 0
    assert rel_err(a1["entropy"], s1["entropy"]) < 1e-5  # entropy is still reported for every position
    # mean reduction over zero targets is 0 / 0 = NaN in stock too
    a2 = ours(h1, w1, labels1, F32, block_v=SMALL_BLOCK)
    s2 = stock(h1, w1, labels1, F32)
    assert math.isnan(a2["loss"].item()) and math.isnan(s2["loss"].item())


@pytest.mark.parametrize("compute_dtype", [F32, F16])
@pytest.mark.parametrize("ignore_frac", [0.4, 0.0, 1.0])
def test_labelled_rows_first_gives_the_same_results(device, compute_dtype, ignore_frac):
    """labelled_rows (the caller's count of non-ignored shift labels): the gradient GEMM runs on the
    labelled rows only, moved first. Per-token results, the loss and the gradient are those of the
    plain call up to the GEMMs' rounding (a row at another place in a chunk, a gradient GEMM of
    another row count: fp32 on the CPU moved entropies by ~1 ulp), the gradient exactly zero on
    every unlabelled row, with chunks that straddle the labelled / unlabelled boundary (7-row
    chunks, 3 x 11 rows)."""
    h, w, labels = make_inputs(3, 11, 48, 1000, device, ignore_frac=ignore_frac, seed=7)
    shift = shift_labels_like_stock(labels)
    n_lab = int((shift != IGNORE_INDEX).sum())
    kw = dict(num_items=max(n_lab, 1), chunk_rows=7, block_v=SMALL_BLOCK)
    plain = ours(h, w, labels, compute_dtype, **kw)
    first = ours(h, w, labels, compute_dtype, labelled_rows=n_lab, **kw)
    # values: fp32 math on the logits; with fp16 compute another row count may flip a logit's fp16
    # rounding on the GPU (as in assert_close_to_stock): 1e-4. The gradient: GRAD16_TOL.
    tol, grad_tol = (1e-4, GRAD16_TOL) if compute_dtype == F16 else (1e-6, 1e-6)
    for key in ("argmax", "correct", "total"):
        assert torch.equal(first[key], plain[key]), key
    for key in ("entropy", "token_loss", "loss"):
        assert rel_err(first[key], plain[key]) <= tol, key
    assert torch.count_nonzero(first["grad"][shift == IGNORE_INDEX]) == 0
    assert first["grad"].shape == plain["grad"].shape and rel_err(first["grad"], plain["grad"]) <= grad_tol
    s = stock(h, w, labels, compute_dtype, num_items=max(n_lab, 1))
    assert_close_to_stock(first, s, compute_dtype)


def test_large_logits(device):
    """Logits up to ~6e4 (near the fp16 limit 65504): fp32 online log-sum-exp must stay finite and
    match stock's fp32 upcast."""
    h, w, labels = make_inputs(1, 23, 32, 1000, device, scale=1.0, seed=5)
    h = h * (6.0e4 / F.linear(h, w).abs().max())
    logits16 = F.linear(h.half(), w.half())
    assert torch.isfinite(logits16).all() and logits16.abs().max() > 3e4
    a = ours(h, w, labels, F16, num_items=20, block_v=SMALL_BLOCK)
    s = stock(h, w, labels, F16, num_items=20)
    assert torch.isfinite(a["loss"]) and torch.isfinite(a["grad"]).all()
    assert_close_to_stock(a, s, F16)


def test_argmax_ties_first_index(device):
    """Duplicate head rows give exactly tied logits, inside one block (3, 7) and across blocks
    (5 and 900 with block 256): torch.argmax returns the first index, so must we."""
    vocab = 1000
    h, w, labels = make_inputs(1, 12, 16, vocab, device, seed=6)
    w[7] = w[3]
    w[900] = w[5]
    h = h.clone()
    h[0, :6] = w[3] * 5.0  # make row 3 / 7 the max for the first tokens
    h[0, 6:] = w[5] * 5.0  # and row 5 / 900 for the others
    a = ours(h, w, labels, F32, block_v=SMALL_BLOCK)
    s = stock(h, w, labels, F32)
    assert a["argmax"][0, :6].tolist() == [3] * 6 and a["argmax"][0, 6:].tolist() == [5] * 6
    assert torch.equal(a["argmax"].cpu(), s["argmax"].cpu())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the inf / NaN rows
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("block_rows", [None, 1])
def test_gradient_bookkeeping_keeps_argmax_and_loss(device, dtype, block_rows):
    """With the gradient (WRITE_GRAD) the kernel's block reduction runs over the non-label columns
    and puts the label's logit back as a scalar: argmax (first index of the max, a NaN or +inf as
    the max), loss and entropy must be those of the kernel without it, bit for bit, with the label
    tied with another column before / after it, in its block or another, NaN or +inf at the label,
    the label in the ragged last block, ignored and out-of-range labels. The row's largest
    non-label p and its column (stats) are the tied column's."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(12, 1000, generator=g) * 2
    labels = torch.randint(0, 1000, (12,), generator=g)
    top = float(logits.max()) + 1
    for r, (y, other) in enumerate([(10, 40), (40, 10), (900, 5), (5, 900)]):  # label tied with `other`
        labels[r], logits[r, y], logits[r, other] = y, top, top
    labels[4], logits[4, 7], logits[4, 300] = 7, float("nan"), float("nan")
    labels[5], logits[5, 7], logits[5, 300] = 300, float("nan"), float("nan")
    labels[6], logits[6, 20] = 20, float("inf")
    labels[7], logits[7, 999] = 999, top
    labels[8], logits[8, 600], logits[8, 601] = 600, top, top
    labels[9], labels[10] = IGNORE_INDEX, 1000
    logits, labels = logits.to(dtype).to(device), labels.to(device)
    kw = dict(block_v=SMALL_BLOCK, block_rows=block_rows)
    with_grad = _row_outputs(logits, labels, lm_mod.launch_rows_kernel, True, **kw)
    without = _row_outputs(logits, labels, lm_mod.launch_rows_kernel, False, **kw)
    for i, name in ((1, "loss"), (2, "entropy"), (3, "argmax")):
        torch.testing.assert_close(with_grad[i], without[i], rtol=0, atol=0, equal_nan=True, msg=name)
    assert with_grad[3][:9].tolist() == [10, 10, 5, 5, 7, 7, 20, 999, 600]
    stats = with_grad[4].cpu()
    assert stats[:4, 3].tolist() == [40.0, 10.0, 5.0, 900.0]  # the tied non-label column
    assert torch.equal(stats[:4, 1], stats[:4, 0])  # ... whose p is the label's


def test_no_grad_and_out_of_range_label(device):
    h, w, labels = make_inputs(1, 10, 32, 1000, device, seed=7)
    with torch.no_grad():
        res = fused_lm_head_loss(h, w, shift_labels_like_stock(labels), compute_dtype=F32, block_v=SMALL_BLOCK)
    s = stock(h, w, labels, F32)
    assert not res.loss.requires_grad and rel_err(res.loss, s["loss"]) < 1e-5
    bad = labels.clone()
    bad[0, 3] = 5000  # stock raises (index out of bounds); we make the loss NaN, never read memory
    res = fused_lm_head_loss(h, w, shift_labels_like_stock(bad), compute_dtype=F32, block_v=SMALL_BLOCK)
    assert math.isnan(res.loss.item())
    assert math.isnan(res.token_loss[0, 2].item()) and torch.isfinite(res.token_loss[0, 3:]).all()


def test_plan_chunk_rows():
    # real shape: 2048 tokens, V = 151936 fp16, 256 MiB -> at most 880 rows -> 3 balanced chunks
    rows = plan_chunk_rows(2048, 151936, 2)
    assert rows % 16 == 0 and rows * 151936 * 2 <= 256 * 1024 * 1024 and math.ceil(2048 / rows) == 3
    assert plan_chunk_rows(37, 1000, 4) == 37
    assert plan_chunk_rows(5000, 151936, 2, budget_bytes=1) == 16  # never below one aligned block
    # the interpreter aligns chunks to its 64-row tiles: fp32, 441 rows fit -> 384-row chunks
    assert plan_chunk_rows(2048, 151936, 4, row_align=64) == 384


def _row_outputs(logits, labels, fn, write_grad, **kw):
    logits = logits.clone()
    n = logits.shape[0]
    loss, ent = torch.empty(n, device=logits.device), torch.empty(n, device=logits.device)
    arg = torch.empty(n, dtype=torch.int64, device=logits.device)
    stats = torch.full((n, 4), -7.0, device=logits.device)
    fn(logits, labels, loss, ent, arg, write_grad, stats=stats, **kw)
    return logits, loss, ent, arg, stats


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("write_grad", [True, False])
def test_torch_route_matches_kernel(device, dtype, write_grad):
    """rows_reference_torch (big chunks under the interpreter) computes what the kernel computes:
    ignored and out-of-range labels, ties across blocks, ragged vocab. Tolerances: same fp32
    formulas in another summation order (1e-6); the fp16 gradient may differ by one fp16 rounding
    of a few elements (rel. 1e-3)."""
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(29, 1000, generator=g) * 4).to(dtype)
    logits[3, 900] = logits[3, 5] = logits[3].max() + 1  # a tie across 256-wide blocks
    labels = torch.randint(0, 1000, (29,), generator=g)
    labels[::4] = IGNORE_INDEX
    labels[5] = 5000
    logits, labels = logits.to(device), labels.to(device)
    k = _row_outputs(logits, labels, lm_mod.launch_rows_kernel, write_grad, block_v=SMALL_BLOCK, block_rows=8)
    t = _row_outputs(logits, labels, lm_mod.rows_reference_torch, write_grad, rows_per_step=10)
    assert torch.equal(k[3], t[3]) and int(k[3][3]) == 5
    finite = labels != 5000
    assert math.isnan(k[1][5].item()) and math.isnan(t[1][5].item())
    assert rel_err(k[1][finite], t[1][finite]) < 1e-6 and rel_err(k[2], t[2]) < 1e-6
    if write_grad:
        assert rel_err(k[0], t[0]) < (1e-3 if dtype == F16 else 1e-6)
        assert torch.count_nonzero(t[0][labels == IGNORE_INDEX]) == 0
        # backward's overflow inputs (stats = p_label, p1, p2, column of p1), on the labelled rows
        # (ignored rows' are never read); the label's p is NaN for an out-of-range label
        lab = labels != IGNORE_INDEX
        ks, ts = k[4], t[4]
        assert math.isnan(ks[5, 0].item()) and math.isnan(ts[5, 0].item())
        assert rel_err(ks[lab & finite, :3], ts[lab & finite, :3]) < 1e-6 and rel_err(ks[5, 1:3], ts[5, 1:3]) < 1e-6
        assert bool((ks[lab, 1] >= ks[lab, 2]).all())
        distinct = lab & (ks[:, 1] > ks[:, 2])  # on a tie for p1 either column is right
        assert torch.equal(ks[distinct, 3], ts[distinct, 3])
        assert bool((labels[distinct] != ks[distinct, 3].long()).all()) and bool((ks[lab, 3] >= 0).all())
    else:
        assert torch.equal(k[0], logits) and torch.equal(t[0], logits)  # read only


def test_interpreter_routes_big_chunks_to_torch(device, monkeypatch):
    """Above INTERP_KERNEL_MAX_LOGITS the interpreter takes the PyTorch route (counted separately);
    results as stock. On the GPU the kernel always runs."""
    monkeypatch.setattr(lm_mod, "INTERP_KERNEL_MAX_LOGITS", 0)
    h, w, labels = make_inputs(2, 19, 32, 1000, device, seed=9)
    _launches.reset()
    a = ours(h, w, labels, F16, num_items=20, chunk_rows=16)  # 3 chunks
    routed = "_lm_head_ce_rows_torch" if device == "cpu" else "_lm_head_ce_rows_kernel"
    assert _launches.LAUNCHES[routed] == 3 and _launches.LAUNCHES["_lm_head_ce_bwd_kernel"] == 1  # + backward
    assert sum(_launches.LAUNCHES.values()) == 4
    assert_close_to_stock(a, stock(h, w, labels, F16, num_items=20), F16)


# --------------------------------------------------------------------------------------------------
# the patch: tiny Qwen2 model, direct forward
# --------------------------------------------------------------------------------------------------
def tiny_qwen2(device, vocab=1000, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=vocab - 2, eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(device)
    with torch.no_grad():  # make argmax meaningful: a strong embedding dominates the residual stream
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
    model.lm_head.weight.requires_grad_(False)  # tied and frozen, as after prepare_model_for_kbit_training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture
def patched():
    """Install the patch for one test, restore the stock objects afterwards."""
    from solution.patches import qwen2_lm_head_loss as patch
    from solution.patches._base import Swaps

    assert patch.check() is None, patch.check()
    swaps = Swaps()
    patch.install(swaps)
    yield patch
    swaps.restore()


def test_patch_forward_direct(device, patched):
    model = tiny_qwen2(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 998, (2, 13), generator=g).to(device)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX
    mask = torch.ones_like(ids)

    # without the request (any caller but our compute_loss): stock outputs, logits present
    out_plain = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out_plain.logits is not None and out_plain.logits.shape == (2, 13, 1000)

    _launches.reset()
    with patched.fused_lm_head_requested():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(20))
        out_keep = model(input_ids=ids, attention_mask=mask, logits_to_keep=1)  # no labels: stock
        out_tuple = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert _launches.LAUNCHES["_lm_head_ce_rows_kernel"] >= 2
    assert out.logits is None and out_keep.logits.shape == (2, 1, 1000)
    assert isinstance(out_tuple, tuple) and out_tuple[0].dim() == 0

    ref_model = copy.deepcopy(model)
    model.zero_grad()
    out.loss.backward()
    # the same weights through the stock path (the patched forward outside the request is stock)
    ref = ref_model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(20))
    ref.loss.backward()
    assert rel_err(out.loss, ref.loss) < 1e-5
    assert rel_err(out.token_entropy, entropy_from_logits(ref.logits.detach())) < 1e-5
    assert torch.equal(out.token_argmax, ref.logits.argmax(-1))
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        if p_ref.grad is not None:
            assert rel_err(p.grad, p_ref.grad) < 1e-4, name


def test_patch_check_and_revert():
    import solution.patches.qwen2_lm_head_loss as patch
    from solution.patches._base import Swaps
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
    from trl.trainer.sft_trainer import SFTTrainer

    stock_fwd, stock_cl = Qwen2ForCausalLM.__dict__["forward"], SFTTrainer.__dict__["compute_loss"]
    swaps = Swaps()
    patch.install(swaps)
    assert Qwen2ForCausalLM.__dict__["forward"] is not stock_fwd
    assert SFTTrainer.__dict__["compute_loss"] is not stock_cl
    import inspect
    assert inspect.signature(Qwen2ForCausalLM.forward) == inspect.signature(stock_fwd)
    swaps.restore()
    assert Qwen2ForCausalLM.__dict__["forward"] is stock_fwd and SFTTrainer.__dict__["compute_loss"] is stock_cl


def test_apply_and_revert_through_solution(monkeypatch):
    """solution.apply() installs the patch when it is listed in PATCHES; solution.revert() restores."""
    import solution
    import solution._apply as apply_mod
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
    from trl.trainer.sft_trainer import SFTTrainer

    solution.revert()
    stock_fwd, stock_cl = Qwen2ForCausalLM.__dict__["forward"], SFTTrainer.__dict__["compute_loss"]
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.qwen2_lm_head_loss"])
    try:
        assert "qwen2_lm_head_loss" in solution.apply(verbose=False)
        assert Qwen2ForCausalLM.__dict__["forward"] is not stock_fwd
    finally:
        solution.revert()
    assert Qwen2ForCausalLM.__dict__["forward"] is stock_fwd and SFTTrainer.__dict__["compute_loss"] is stock_cl


# --------------------------------------------------------------------------------------------------
# the patch in a real trl SFTTrainer run: every logged metric, with and without the patch
# --------------------------------------------------------------------------------------------------
def _tiny_tokenizer(vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 2)}
    words["<pad>"], words["<eos>"] = vocab - 2, vocab - 1
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def _tiny_dataset(vocab, n=8):
    """Pre-tokenized rows (prompt + completion, loss on the completion only, variable lengths ->
    right padding). Runs of repeated tokens, so the tied head predicts some of them right."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = []
        while len(ids) < int(torch.randint(8, 20, (1,), generator=g)):
            ids += [int(torch.randint(0, vocab - 2, (1,), generator=g))] * int(torch.randint(1, 4, (1,), generator=g))
        p = int(torch.randint(2, len(ids) - 2, (1,), generator=g))
        rows.append({"input_ids": ids, "completion_mask": [0] * p + [1] * (len(ids) - p)})
    return Dataset.from_list(rows)


def _make_trainer(device, precision, out_dir, lora, trainer_cls=None):
    from trl import SFTConfig, SFTTrainer

    vocab = 1000
    model = tiny_qwen2(device, vocab)
    if lora:  # what Soup trains: a PeftModel with LoRA on q/v, gradient checkpointing on
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    args = SFTConfig(output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                     report_to=[], use_cpu=(device == "cpu"), fp16=(precision == "fp16"),
                     bf16=(precision == "bf16"), gradient_checkpointing=lora, save_strategy="no", seed=0,
                     learning_rate=1e-2 if lora else 1e-3, disable_tqdm=True)
    return (trainer_cls or SFTTrainer)(model=model, args=args, train_dataset=_tiny_dataset(vocab),
                                       processing_class=_tiny_tokenizer(vocab))


@contextlib.contextmanager
def _lm_head_patch(use_patch: bool):
    """The LM-head patch installed (or not) for the block, our launch counter reset at its start."""
    from solution.patches import qwen2_lm_head_loss as patch
    from solution.patches._base import Swaps

    swaps = Swaps()
    if use_patch:
        patch.install(swaps)
    _launches.reset()
    try:
        yield
    finally:
        swaps.restore()


def _train_logs(device, use_patch, precision, out_dir, lora):
    trainer = _make_trainer(device, precision, out_dir, lora)
    with _lm_head_patch(use_patch):
        trainer.train()
        launches = _launches.LAUNCHES["_lm_head_ce_rows_kernel"]
        # evaluation goes through trl's stock compute_loss (logits needed for eval metrics)
        trainer.evaluate(eval_dataset=_tiny_dataset(1000, n=4))
        assert _launches.LAUNCHES["_lm_head_ce_rows_kernel"] == launches
    logs = [h for h in trainer.state.log_history if "loss" in h]
    eval_log = [h for h in trainer.state.log_history if "eval_loss" in h][-1]  # trl merges its eval metrics here
    return logs, launches, {k: v for k, v in eval_log.items() if "runtime" not in k and "per_second" not in k}


@pytest.mark.parametrize("precision,lora", [
    ("fp32", False), ("fp32", True),
    ("bf16", False),  # CPU bf16 autocast (trl's default off-GPU): the patch must fall back to stock
    pytest.param("fp16", True, marks=pytest.mark.gpu),  # the workload's setting: fp16 autocast + GradScaler
])
def test_sft_trainer_metrics_with_and_without_patch(device, tmp_path, precision, lora):
    if precision == "fp16" and device != "cuda":
        pytest.skip("fp16 mixed precision needs CUDA")
    if precision == "bf16" and device == "cuda":
        pytest.skip("the bf16 fallback case is the CPU-autocast one")
    stock_logs, stock_launches, stock_eval = _train_logs(device, False, precision, tmp_path / "stock", lora)
    ours_logs, our_launches, our_eval = _train_logs(device, True, precision, tmp_path / "ours", lora)
    assert set(stock_eval) == set(our_eval) and "eval_mean_token_accuracy" in our_eval
    assert stock_launches == 0
    assert our_launches == (0 if precision == "bf16" else 2)  # one chunk per step, two steps
    assert len(stock_logs) == len(ours_logs) == 2
    assert stock_logs[1]["mean_token_accuracy"] > 0  # the metric is exercised, not trivially 0
    for s, o in zip(stock_logs, ours_logs):
        assert set(s) == set(o)  # same metric names: nothing added, nothing lost
        for key in ("num_tokens", "mean_token_accuracy", "learning_rate", "epoch", "step"):
            assert o[key] == s[key], (key, o[key], s[key])
        # fp32: same math up to summation order; fp16 (GPU only, unverified here; kept): 2e-3 ~
        # GRAD16_TOL, the hidden-state gradients' distance from stock (module doc). grad_norm is a
        # norm of gradients linear in it (| |a| - |b| | <= |a - b|), step 2's loss and the evaluation
        # run on weights one update of those gradients apart. Not counted: the stock backward below
        # the LM head rounds the two (different) gradients in its own fp16 ops.
        tol = 2e-3 if precision == "fp16" else 1e-5
        for key in ("loss", "entropy", "grad_norm"):
            assert abs(o[key] - s[key]) <= tol * max(1.0, abs(s[key])), (key, o[key], s[key])
    for key in stock_eval:  # after two steps on slightly different gradients (fp16) / equal ones (fp32)
        assert abs(our_eval[key] - stock_eval[key]) <= tol * max(1.0, abs(stock_eval[key])), key


# --------------------------------------------------------------------------------------------------
# Soup's rewind recorder (a subclass of the SFTTrainer) must still get its per-row losses
# --------------------------------------------------------------------------------------------------
class _ListSink:
    """Soup's RewindSink protocol, collecting the records in a list."""

    def __init__(self):
        self.records = []

    def record_batch(self, *, step, micro, rows, row_loss, row_tokens):
        self.records.append(dict(step=step, micro=micro, rows=list(rows), row_loss=list(row_loss),
                                 row_tokens=list(row_tokens)))


def _rewind_run(device, use_patch, precision, out_dir):
    rewind_hf = pytest.importorskip("soup_cli.trainer.rewind_hf")
    from soup_cli.utils.stream_loss_chunk import STEP_ATTR
    from trl import SFTTrainer

    # as Soup's SFT wrapper does: make_rewind_trainer_class(SFTTrainer), then attach_rewind_state
    trainer = _make_trainer(device, precision, out_dir, lora=True,
                            trainer_cls=rewind_hf.make_rewind_trainer_class(SFTTrainer))
    sink = _ListSink()
    state = rewind_hf.attach_rewind_state(trainer, sink)
    with _lm_head_patch(use_patch):
        trainer.train()
        step_after_train = getattr(trainer, STEP_ATTR, None)
        trainer.evaluate(eval_dataset=_tiny_dataset(1000, n=4))
        step_after_eval = getattr(trainer, STEP_ATTR, None)
    assert not state.failed and state.dropped == 0  # no "Rewind recorder disabled", nothing dropped
    return sink.records, step_after_train, step_after_eval, _launches.LAUNCHES["_lm_head_ce_rows_kernel"]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.gpu)])
def test_soup_rewind_recorder_row_losses(device, tmp_path, precision):
    """Soup's rewind trainer around the SFTTrainer, 2 steps, with and without the patch: the same
    rows, token counts and per-row losses. With the patch the outputs carry no logits and the
    recorder reads trainer._soup_chunked_step.token_loss; stock reads outputs.logits (fp32 here:
    accelerate converts the outputs). Tolerance: fp32 1e-5 (same logits, fp32 math in another
    order); fp16 2e-3 (step 2 runs on weights updated with differently rounded fp16 gradients,
    as in the SFTTrainer test)."""
    if precision == "fp16" and device != "cuda":
        pytest.skip("fp16 mixed precision needs CUDA")
    from solution.patches.qwen2_lm_head_loss import FusedLMHeadStep

    stock_rec, stock_step, _, stock_launches = _rewind_run(device, False, precision, tmp_path / "stock")
    our_rec, our_step, our_step_eval, our_launches = _rewind_run(device, True, precision, tmp_path / "ours")
    assert stock_launches == 0 and our_launches == 2
    assert len(stock_rec) == len(our_rec) == 2  # one record per micro-batch, two steps
    tol = 2e-3 if precision == "fp16" else 1e-5  # fp16: GPU only, unverified here (the SFTTrainer test's note)
    for s, o in zip(stock_rec, our_rec):
        assert (o["step"], o["micro"], o["rows"], o["row_tokens"]) == (s["step"], s["micro"], s["rows"], s["row_tokens"])
        assert len(o["row_loss"]) == 4 and all(x > 0 for x in s["row_loss"])
        for x, y in zip(o["row_loss"], s["row_loss"]):
            assert abs(x - y) <= tol * max(1.0, abs(y)), (o["row_loss"], s["row_loss"])
    # the fused step leaves [B, T] fp32 per-token losses; a stock call (evaluation) clears them
    assert stock_step is None and isinstance(our_step, FusedLMHeadStep)
    assert our_step.token_loss.dtype == F32 and our_step.token_loss.dim() == 2 and our_step.token_loss.shape[0] == 4
    assert our_step_eval is None


# --------------------------------------------------------------------------------------------------
# GPU: the real shape (4 x 512 tokens, hidden 1536, vocab 151936), fp16 autocast as in training
# --------------------------------------------------------------------------------------------------
def _real_inputs(device, n_tokens=2048, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(4, n_tokens // 4, 1536, device=device, generator=g)
    w = torch.randn(151936, 1536, device=device, generator=g) * 0.1  # logits std ~4, max ~25
    labels = torch.randint(0, 151936, (4, n_tokens // 4), device=device, generator=g)
    labels[:, : n_tokens // 16] = IGNORE_INDEX  # prompt tokens
    labels[3, n_tokens // 8:] = IGNORE_INDEX  # a padded row
    return h, w, labels


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [2048, 1500])
def test_gpu_real_shape(device, n_tokens):
    assert device == "cuda"
    h, w, labels = _real_inputs(device, n_tokens)
    _launches.reset()
    n = (labels[..., 1:] != IGNORE_INDEX).sum()
    with torch.autocast(device, dtype=F16):
        a = ours(h, w, labels, None, num_items=n, grad_out=65536.0)
    with torch.autocast(device, dtype=F16):
        s = stock(h, w, labels, F16, num_items=n, grad_out=65536.0)
    # cuBLAS may pick another algorithm for a chunk than for the whole matrix, flipping rare fp16
    # roundings of a logit by one ulp: compare loss/entropy at 1e-4 and argmax on 99.9% of tokens.
    assert rel_err(a["loss"], s["loss"]) < 1e-4
    assert rel_err(a["entropy"], s["entropy"]) < 1e-4
    assert (a["argmax"] == s["argmax"]).float().mean() > 0.999
    assert abs(int(a["correct"]) - int(s["correct"])) <= 2
    assert rel_err(a["grad"], s["grad"]) < GRAD16_TOL
    assert rel_err(a["token_loss"], s["token_loss"]) < 1e-4
    # every chunk through the kernel (2048 tokens: 3 chunks of 688 rows; 1500 tokens: 2 of 752)
    n_rows = labels.numel()
    chunks = math.ceil(n_rows / plan_chunk_rows(n_rows, w.shape[0], 2, row_align=lm_mod.ROW_ALIGN))
    assert chunks == {2048: 3, 1500: 2}[n_tokens]
    assert _launches.LAUNCHES["_lm_head_ce_rows_kernel"] == chunks


@pytest.mark.gpu
def test_gpu_large_logits_and_memory(device):
    assert device == "cuda"
    h, w, labels = _real_inputs(device, 2048, seed=1)
    n = (labels[..., 1:] != IGNORE_INDEX).sum()
    with torch.no_grad(), torch.autocast(device, dtype=F16):
        h = h * (3.0e4 / F.linear(h[:, :64], w).float().abs().max())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast(device, dtype=F16):
        a = ours(h, w, labels, None, num_items=n, grad_out=65536.0)
    ours_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast(device, dtype=F16):
        s = stock(h, w, labels, F16, num_items=n, grad_out=65536.0, with_token_loss=False)  # not in stock's step
    stock_peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(a["loss"]) and torch.isfinite(a["grad"]).all()
    assert rel_err(a["loss"], s["loss"]) < 1e-4 and rel_err(a["grad"], s["grad"]) < GRAD16_TOL
    assert ours_peak < stock_peak / 2, (ours_peak, stock_peak)


def test_fallback_message_is_said_once(capsys):
    from solution import say

    say._SAID.discard("test reason")
    say.say_once("test reason")
    say.say_once("test reason")
    assert capsys.readouterr().out.count("[solution] test reason") == 1


def test_frozen_weight_cast_is_reused_only_while_the_weight_is_unchanged(device):
    """cast_frozen_weight: the same fp16 bits as weight.to(fp16); reused for the same unchanged
    tensor; recast after an in-place write, for another tensor (even one with the same values),
    for a weight that requires grad (never cached), and after clear_weight_cache()."""
    lm_mod.clear_weight_cache()
    w = torch.randn(50, 16, device=device)
    a = lm_mod.cast_frozen_weight(w, torch.float16)
    assert a.dtype == torch.float16 and torch.equal(a, w.to(torch.float16))
    assert lm_mod.cast_frozen_weight(w, torch.float16) is a  # reused
    with torch.no_grad():
        w.mul_(2.0)  # bumps the version counter
    b = lm_mod.cast_frozen_weight(w, torch.float16)
    assert b is not a and torch.equal(b, w.to(torch.float16))
    w2 = w.clone()
    assert lm_mod.cast_frozen_weight(w2, torch.float16) is not b
    trained = torch.nn.Parameter(torch.randn(50, 16, device=device))
    assert lm_mod.cast_frozen_weight(trained, torch.float16) is not lm_mod.cast_frozen_weight(trained, torch.float16)
    assert lm_mod.cast_frozen_weight(w, torch.float32) is w  # already that dtype: no copy
    lm_mod.clear_weight_cache()
    assert not lm_mod._WEIGHT_CACHE


def test_frozen_weight_cache_can_be_turned_off(device):
    """cache=False casts every call (the reference for the cached copy)."""
    w = torch.randn(20, 8, device=device)
    assert lm_mod.cast_frozen_weight(w, torch.float16, cache=False) is not lm_mod.cast_frozen_weight(
        w, torch.float16, cache=False)

