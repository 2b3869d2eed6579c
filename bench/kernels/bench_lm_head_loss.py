"""GPU benchmark: stock LM head + loss + trl metrics vs solution's fused chunked LM head loss.

    python bench/kernels/bench_lm_head_loss.py --out lm_head_loss.json

The workload's shapes: hidden 1536, vocab 151936, tokens 4 x 512 = 2048 (a full batch) and
4 x 375 = 1500 (~ a real batch); hidden states fp32 (the final RMSNorm's fp32 output), the tied head
fp32 and frozen (peft's prepare_model_for_kbit_training), fp16 autocast, GradScaler factor 65536.

stock = what one training step does today, forward + backward:
    autocast fp16: logits = F.linear(h, W); loss = ForCausalLMLoss(logits, labels, num_items_in_batch)
    accelerate's convert_outputs_to_fp32: logits.float()
    trl: entropy_from_logits(logits) masked mean; argmax(logits[:, :-1]) == labels[:, 1:] accuracy
    Soup's rewind recorder (training.rewind_log, on by default): row_losses(logits, labels)
    (loss * 65536).backward()
ours = fused_lm_head_loss (same outputs: loss, per-token loss, entropy and argmax) + the same two
masked means + Soup's row_losses_from_token_losses(token_loss, labels) (what the recorder does
with our per-token losses), then (loss * 65536).backward(). Without soup_cli installed both skip
the recorder part (printed).

Also printed: the matmul floor (the two [tokens, 1536] x [1536, 151936] fp16 GEMMs alone), ours at
other chunk budgets, and the row kernel alone (effective bandwidth) at a few block / warp settings.
Median times from triton.testing.do_bench; peak = torch.cuda.max_memory_allocated above the
baseline (inputs and the fp32 head already allocated) during forward + backward.

Rates (bench/kernels/_common.py, rates), of forward + backward (timed together): bytes that must
move = every input read once + every output written once per pass, summed: forward h, W, labels,
attention mask -> loss, entropy, accuracy; backward h, W, labels -> dh (W frozen; the logits are
not a tensor the op must keep). W is counted as the benchmark passes it (fp32, 0.93 GB a pass):
ours reads its cached fp16 copy of the frozen head (cast_frozen_weight), half of that. GB/s =
bytes / median time, % of a same-size copy (a uint8 copy moving those bytes, timed once per byte
count), TFLOP/s = the two GEMMs' 2 M N K each / time: forward logits 2 T V H, backward dh 2 T V H,
4 T V H in all (T = tokens, every position: the GEMMs run on all rows). The matmul floor row
counts its own tensors' bytes (h16, W16 -> dlogits; dlogits, W16 -> dh16). The row kernel alone:
bytes = logits read + its gradient written in place + labels read + loss, entropy, argmax written
(its "effective GB/s" column counts the three passes it makes over the logits, 2 reads + 1 write).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import bench_args, nbytes, rate_cells, rates  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from solution.kernels import lm_head_loss as ours_mod  # noqa: E402

HIDDEN, VOCAB = 1536, 151936
SHAPES = [(4, 512), (4, 375)]
GRAD_SCALER = 65536.0
try:  # Soup's rewind recorder (on by default in the workload): per-row losses every step
    from soup_cli.trainer.rewind_hf import row_losses, row_losses_from_token_losses
except ImportError:  # pragma: no cover - bench without Soup
    row_losses = row_losses_from_token_losses = None


def make_inputs(batch, seq, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(batch, seq, HIDDEN, device="cuda", generator=g).requires_grad_(True)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.1  # logits std ~4
    labels = torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=g)
    labels[:, : seq // 3] = -100  # prompt tokens carry no loss
    attention = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    labels[-1, seq * 3 // 4:] = -100  # the last row is padded
    attention[-1, seq * 3 // 4:] = 0
    n_items = (labels[..., 1:] != -100).sum()
    return h, w, labels, attention, n_items


def stock_step(h, w, labels, attention, n_items):
    from transformers.loss.loss_utils import ForCausalLMLoss
    from trl.trainer.utils import entropy_from_logits

    with torch.autocast("cuda", dtype=torch.float16):
        logits = F.linear(h, w)
        loss = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=n_items)
    logits = logits.float()  # accelerate converts the model outputs to fp32
    with torch.no_grad():
        entropy = (entropy_from_logits(logits) * attention).sum() / attention.sum()
        preds = logits[..., :-1, :].contiguous().argmax(dim=-1)
        shift = labels[..., 1:]
        mask = shift != -100
        accuracy = ((preds == shift) & mask).sum() / mask.sum()
        if row_losses is not None:
            row_losses(logits, labels)
    del logits
    (loss * GRAD_SCALER).backward()
    return loss.detach(), entropy, accuracy


def ours_step(h, w, labels, attention, n_items, chunk_rows=None):
    with torch.autocast("cuda", dtype=torch.float16):
        res = ours_mod.fused_lm_head_loss(h, w, ours_mod.shift_labels_like_stock(labels),
                                          num_items_in_batch=n_items, chunk_rows=chunk_rows)
    with torch.no_grad():
        entropy = (res.token_entropy * attention).sum() / attention.sum()
        shift = labels[..., 1:]
        mask = shift != -100
        accuracy = ((res.token_argmax[..., :-1] == shift) & mask).sum() / mask.sum()
        if row_losses_from_token_losses is not None:
            row_losses_from_token_losses(res.token_loss, labels)
    (res.loss * GRAD_SCALER).backward()
    return res.loss.detach(), entropy, accuracy


def matmul_floor(h, w):
    """The two lm_head GEMMs every implementation must do (logits, and dlogits @ W), fp16:
    (median ms, bytes their inputs and outputs move)."""
    h16, w16 = h.detach().half().view(-1, HIDDEN), w.half()
    dl = torch.empty(h16.shape[0], VOCAB, device="cuda", dtype=torch.float16)

    dh = torch.empty_like(h16)

    def run():
        torch.mm(h16, w16.t(), out=dl)
        torch.mm(dl, w16, out=dh)

    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    return ms, nbytes(h16, w16, dl) + nbytes(dl, w16, dh)


def timed(fn, h):
    return triton.testing.do_bench(fn, warmup=100, rep=1000, grad_to_none=[h], return_mode="median")


def peak_mib(fn, h):
    h.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = None
    return peak / 2**20


def bench_shape(batch, seq):
    h, w, labels, attention, n_items = make_inputs(batch, seq)
    args = (h, w, labels, attention, n_items)
    rows = []
    # correctness guard: both compute the same things
    s_loss, s_ent, s_acc = stock_step(*args)
    s_grad = h.grad.clone()
    h.grad = None
    o_loss, o_ent, o_acc = ours_step(*args)
    check = {"loss_abs_diff": (o_loss - s_loss).abs().item(), "entropy_abs_diff": (o_ent - s_ent).abs().item(),
             "accuracy_abs_diff": (o_acc - s_acc).abs().item(),
             "grad_rel_err": ((h.grad - s_grad).norm() / s_grad.norm()).item()}
    h.grad = None
    del s_grad
    tokens = batch * seq
    # fwd: h, W, labels, attention -> loss, entropy, accuracy; bwd: h, W, labels -> dh (h's shape and dtype)
    op_bytes = nbytes(h, w, labels, attention, s_loss, s_ent, s_acc) + nbytes(h, w, labels, h)
    flops = 4 * tokens * VOCAB * HIDDEN  # logits (fwd) + dh (bwd), 2 M N K each
    rows.append({"impl": "stock", "tokens": tokens, "fwd_bwd_ms": timed(lambda: stock_step(*args), h),
                 "peak_MiB": peak_mib(lambda: stock_step(*args), h)})
    for budget_mib in (128, 256, 512):
        chunk = ours_mod.plan_chunk_rows(tokens, VOCAB, 2, budget_mib * 2**20)
        name = f"ours ({budget_mib} MiB chunks, {chunk} rows)" + (" [default]" if budget_mib == 256 else "")
        rows.append({"impl": name, "tokens": tokens, "chunk_rows": chunk,
                     "fwd_bwd_ms": timed(lambda: ours_step(*args, chunk_rows=chunk), h),
                     "peak_MiB": peak_mib(lambda: ours_step(*args, chunk_rows=chunk), h)})
    for r in rows:
        r.update(rates(op_bytes, r["fwd_bwd_ms"], flops, "fwd_bwd_"))
    floor_ms, floor_bytes = matmul_floor(h, w)
    rows.append({"impl": "matmul floor (2 fp16 GEMMs)", "tokens": tokens, "fwd_bwd_ms": floor_ms,
                 "peak_MiB": float("nan"), **rates(floor_bytes, floor_ms, flops, "fwd_bwd_")})
    return rows, check


def bench_row_kernel(rows=880):
    """The row kernel alone on one chunk of fp16 logits (2 reads + 1 write of the chunk), at the
    default tile (1 row x 2048 columns, 8 warps) and a few others, 2-D multi-row tiles included
    (bench only: those are not in sm75_specs, training launches the default)."""
    out = []
    logits = (torch.randn(rows, VOCAB, device="cuda") * 4).half()
    labels = torch.randint(0, VOCAB, (rows,), device="cuda")
    loss = torch.empty(rows, device="cuda")
    ent = torch.empty(rows, device="cuda")
    arg = torch.empty(rows, dtype=torch.int64, device="cuda")
    for block_rows, block_v, warps in ((1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (1, 4096, 16),
                                       (2, 1024, 8), (4, 1024, 8), (4, 512, 4)):
        ms = triton.testing.do_bench(
            lambda: ours_mod.launch_rows_kernel(logits, labels, loss, ent, arg, True, block_v, warps, block_rows),
            warmup=25, rep=200, return_mode="median")
        gbps = 3 * logits.numel() * 2 / (ms * 1e-3) / 1e9
        # bytes that must move: logits read, their gradient written (in place), labels read, outputs written
        must = nbytes(logits, logits, labels, loss, ent, arg)
        out.append({"block_rows": block_rows, "block_v": block_v, "num_warps": warps, "rows": rows, "ms": ms,
                    "GB_per_s": gbps, **rates(must, ms), "default": (block_rows, block_v, warps) == (
                        ours_mod.BLOCK_ROWS, ours_mod.BLOCK_V, ours_mod.NUM_WARPS)})
    return out


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results, checks = [], {}
    for batch, seq in SHAPES:
        rows, check = bench_shape(batch, seq)
        results += rows
        checks[batch * seq] = check
    kernel_rows = bench_row_kernel()
    print(f"GPU: {torch.cuda.get_device_name()}")
    print(f"Soup rewind recorder included: {row_losses is not None}\n")
    print("| impl | tokens | fwd+bwd ms | peak MiB | speedup vs stock | MB | GB/s | % of a same-size copy | TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        base = next(x for x in results if x["impl"] == "stock" and x["tokens"] == r["tokens"])
        r["speedup_vs_stock"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        print(f"| {r['impl']} | {r['tokens']} | {r['fwd_bwd_ms']:.2f} | {r['peak_MiB']:.0f} | "
              f"{r['speedup_vs_stock']:.2f}x | {r['fwd_bwd_bytes'] / 1e6:.0f} | "
              + " | ".join(rate_cells(r, "fwd_bwd_", True)) + " |")
    print("\nagreement with stock:", json.dumps(checks))
    print("\n| row kernel BLOCK_ROWS x BLOCK_V | warps | rows | ms | effective GB/s (3 passes) | GB/s (bytes that"
          " must move) | % of a same-size copy |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in kernel_rows:
        print(f"| {k['block_rows']} x {k['block_v']}{' (default)' if k['default'] else ''} | {k['num_warps']} | "
              f"{k['rows']} | {k['ms']:.3f} | {k['GB_per_s']:.0f} | " + " | ".join(rate_cells(k)) + " |")
    with open(args.out, "w") as f:
        json.dump({"op": "lm_head_loss", "gpu": torch.cuda.get_device_name(), "hidden": HIDDEN, "vocab": VOCAB,
                   "rewind_recorder_included": row_losses is not None, "results": results,
                   "agreement": checks, "row_kernel": kernel_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
