"""GPU benchmark: attention on the T4's path, ours (variable-length, packed rows) vs stock SDPA on
the padded batch, forward and forward + backward, with TFLOP/s.

    python bench/kernels/bench_attention.py --out attention.json

The T4's path: PyTorch's flash and cuDNN attention backends off (they exist only on sm_80+), as
bench/run_one.py's ``emulate_t4_paths`` sets them for both variants of the training runs, so SDPA
runs the memory-efficient (or math) backend as on a T4. Qwen2.5-1.5B's attention shape: 12 query
heads, 2 KV heads, head dim 128; q/k/v fp32 as the projections give them, fp16 autocast; batches
of 4 rows padded to 512 with 1052, 1652 and 2048 real tokens.

ours  = the variable-length attention as the decoder-layer node calls it (solution/step/layer.py,
        ``_attention`` / ``_attention_grads``): ``attn_varlen.varlen_forward`` /
        ``varlen_backward`` (PyTorch's memory-efficient kernel in its variable-length mode) on the
        packed rows [1, N, 12, 128] fp16, the KV heads already repeated (in the node that copy and
        the fp16 cast are part of kernels/qkv_rope.py's launch, not timed here).
stock = transformers' ``sdpa_attention_forward`` on the padded batch [4, heads, 512, 128] (views
        of [4, 512, heads x 128], as stock Qwen2 passes them), with the boolean causal + padding
        mask transformers builds when a row is padded, none (``is_causal``) when no row is.

Rates (bench/kernels/_common.py, rates), each row from its own tensors: bytes that must move =
every input read once + every output written once, forward q, k, v (+ the mask) -> out,
backward dout, q, k, v (+ the mask) -> dq, dk, dv (ours: the fp16 tensors it is given, 12 KV
heads; stock: its fp32 inputs, 2 KV heads); forward + backward (timed together): the
sum. GB/s = bytes / median time, % of a same-size copy (a uint8 copy moving those bytes, timed
once per byte count). TFLOP/s from the real rows' causal FLOPs (_common.causal_attention_flops:
forward 4 H L^2 D / 2 per row of L tokens, H = 12, D = 128; backward 2.5x the forward): the
useful work, the same for both; stock's row also gives ``TFLOP_s_padded``, the same formula over
4 rows of 512 (what an ``is_causal`` kernel does on the padded batch; with a mask the kernel may
not skip the masked half). Also: the attention kernels each ran (torch.profiler) and the largest
difference between the two outputs on the real tokens.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels._common import (ATTN_BWD_OVER_FWD, bench_args, causal_attention_flops,  # noqa: E402
                                   fwd_and_fwd_bwd_rates, median_ms, nbytes, rate_cells)
from solution.kernels import attn_varlen  # noqa: E402
from solution.step import packing  # noqa: E402

HQ, HKV, D = 12, 2, 128
SEQLEN = 512
CASES = [[512, 300, 180, 60], [512, 470, 390, 280], [512] * 4]  # 1052, 1652, 2048 tokens


class _Attn(torch.nn.Module):
    num_key_value_groups = HQ // HKV
    is_causal = True


def attention_kernels(fn) -> list[str]:
    """Names of the attention GPU kernels one call of ``fn`` runs (which SDPA backend ran)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = ("attention", "fmha", "flash", "softmax", "bmm", "gemm")
    return sorted({e.key[:80] for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA and any(k in e.key.lower() for k in keys)})


def _leaf(t):
    return t.detach().requires_grad_()


def run_case(lengths):
    info = packing.make_unpadded(lengths, SEQLEN, torch.device("cuda"))
    n, b, scale, mod = sum(lengths), len(lengths), D ** -0.5, _Attn()
    cu, max_len = info.cu_seqlens, info.max_len
    torch.manual_seed(0)
    # the packed rows as the projections give them: [1, N, heads x 128] fp32
    packed = {"q": torch.randn(1, n, HQ * D, device="cuda"), "k": torch.randn(1, n, HKV * D, device="cuda"),
              "v": torch.randn(1, n, HKV * D, device="cuda")}
    # the same tokens in the padded batch [4, 512, heads x 128] (zeros at the pads)
    padded = {k: _leaf(packing.pad_rows(t[0], info).view(b, SEQLEN, -1)) for k, t in packed.items()}
    # what the node gives attention: fp16 [1, N, 12, 128], each KV head repeated for its query heads
    rep = HQ // HKV
    ours_in = {k: t.view(1, n, -1, D).repeat_interleave(rep if k != "q" else 1, dim=2).half().contiguous()
               for k, t in packed.items()}
    g = torch.randn(1, n, HQ, D, device="cuda", dtype=torch.float16)
    g_pad = packing.pad_rows(g[0], info).view(b, SEQLEN, HQ, D)
    mask = None
    if min(lengths) < SEQLEN:  # transformers' boolean mask: causal, and only the row's real keys
        pos = torch.arange(SEQLEN, device="cuda")
        real = pos[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        mask = (pos[:, None] >= pos[None, :])[None, None] & real[:, None, None, :]

    def heads(t, h, rows, s):  # [rows, s, h x 128] -> the [rows, h, s, 128] view
        return t.view(rows, s, h, D).transpose(1, 2)

    q16, k16, v16 = ours_in["q"], ours_in["k"], ours_in["v"]

    def ours_fwd():
        return attn_varlen.varlen_forward(q16, k16, v16, cu, max_len, scale)[0]  # [1, N, Hq, D]

    def ours_fwd_bwd():
        out, lse, seed, offset = attn_varlen.varlen_forward(q16, k16, v16, cu, max_len, scale)
        return attn_varlen.varlen_backward(g, q16, k16, v16, out, lse, cu, seed, offset, max_len, scale)

    def stock():
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        q, k, v = (heads(padded[x], h, b, SEQLEN) for x, h in (("q", HQ), ("k", HKV), ("v", HKV)))
        with torch.autocast("cuda", dtype=torch.float16):
            return sdpa_attention_forward(mod, q, k, v, mask, dropout=0.0, scaling=scale)[0]  # [B, S, Hq, D]

    def stock_fwd():
        with torch.no_grad():
            return stock()

    def stock_fwd_bwd():
        stock().backward(g_pad)

    flops = causal_attention_flops(lengths, HQ, D)
    padded_flops = causal_attention_flops([SEQLEN] * b, HQ, D)
    leaves = list(padded.values())
    rows, outs = [], {}
    for impl, fwd, fwd_bwd, ins, grad in (("stock SDPA, padded", stock_fwd, stock_fwd_bwd, leaves, g_pad),
                                          ("ours, varlen", ours_fwd, ours_fwd_bwd, [q16, k16, v16], g)):
        out = fwd()
        outs[impl] = out
        row = {"impl": impl, "tokens": n, "lengths": lengths, "fwd_ms": median_ms(fwd),
               "fwd_bwd_ms": median_ms(fwd_bwd, grad_to_none=leaves if ins is leaves else None),
               "kernels_fwd_bwd": attention_kernels(fwd_bwd)}
        for t in leaves:
            t.grad = None
        # fwd: q, k, v (+ mask) -> out; bwd: dout, q, k, v (+ mask) -> dq, dk, dv (q's, k's, v's shapes and dtypes)
        m = mask if ins is leaves else None
        fwd_and_fwd_bwd_rates(row, nbytes(*ins, m, out), nbytes(grad, *ins, m, *ins),
                              flops, ATTN_BWD_OVER_FWD * flops)
        if ins is leaves:
            row["fwd_TFLOP_s_padded"] = padded_flops / (row["fwd_ms"] * 1e-3) / 1e12
            row["fwd_bwd_TFLOP_s_padded"] = (1 + ATTN_BWD_OVER_FWD) * padded_flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        rows.append(row)
    stock_real = packing.unpad_rows(outs["stock SDPA, padded"].reshape(b * SEQLEN, HQ, D), info)
    rows[-1]["max_abs_diff_vs_stock"] = float((outs["ours, varlen"][0].float() - stock_real.float()).abs().max())
    return rows


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    # the T4's attention backends (bench/run_one.py, emulate_t4_paths); the varlen kernel is called directly
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    backends = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in ("flash", "cudnn", "mem_efficient", "math")}
    results = [r for lengths in CASES for r in run_case(lengths)]
    print(f"GPU: {torch.cuda.get_device_name()}; SDPA backends enabled: {backends}\n")
    print("| impl | tokens | fwd ms | fwd+bwd ms | speedup fwd+bwd | fwd MB | fwd GB/s | fwd % of a same-size copy |"
          " fwd TFLOP/s | fwd+bwd MB | fwd+bwd GB/s | fwd+bwd % of a same-size copy | fwd+bwd TFLOP/s |"
          " fwd+bwd TFLOP/s over the padding | out max abs diff |")
    print("| --- | ---: |" + " ---: |" * 13)
    for i, r in enumerate(results):  # (stock, ours) pairs
        r["speedup_fwd_bwd"] = results[i - i % 2]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        pad = r.get("fwd_bwd_TFLOP_s_padded")
        cells = [r["impl"], str(r["tokens"]), f"{r['fwd_ms']:.4f}", f"{r['fwd_bwd_ms']:.4f}",
                 f"{r['speedup_fwd_bwd']:.2f}x"]
        for p in ("fwd_", "fwd_bwd_"):
            cells += [f"{r[p + 'bytes'] / 1e6:.1f}"] + rate_cells(r, p, True)
        cells += ["" if pad is None else f"{pad:.1f}", f"{r.get('max_abs_diff_vs_stock', '')}"]
        print("| " + " | ".join(cells) + " |")
    print("\nattention kernels per fwd+bwd:")
    for r in results:
        print(f"  {r['impl']}, {r['tokens']} tokens: {', '.join(r['kernels_fwd_bwd']) or 'none found'}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"op": "attention", "gpu": torch.cuda.get_device_name(), "sdpa_backends": backends,
                   "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "seqlen": SEQLEN}, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
