"""GPU benchmark: attention on packed rows, torch's layout ops vs our pad/unpad kernels vs
variable-length attention with no padding vs our own Triton attention.

    python bench/kernels/bench_attn_layout.py --out attn_layout.json

``sdpa_unpadded`` (solution/step/attention.py) at the Qwen2.5-1.5B attention shape (12 query
heads, 2 KV heads, head_dim 128), q/k/v fp32 packed rows as the projections give them, under fp16
autocast, forward and forward + backward, for a batch of 4 rows with lengths like the workload's
(one row at the maximum 512, the others shorter) and for 4 full rows. "stock" here is our own
torch-op path (zeros + index_copy, repeat_kv, autocast's casts, index_select); "ours" the same
attention with the layout moves in solution/kernels/attn_layout.py (the
padded layout's path); "varlen" the packed rows through PyTorch's variable-length memory-efficient
attention, no padded positions (solution/kernels/attn_varlen.py, the default). Also: whether the
outputs and gradients agree, host time and GPU work per call.
SDPA's backends are left as PyTorch picks them (on an sm_80+ GPU the padded rows may run flash
attention): bench_attention.py times attention on the T4's backends.

Rates (bench/kernels/_common.py, rates; the same for the three, which take the same packed
tensors): bytes that must move = every input read once + every output written once, forward
q, k, v (fp32 packed rows) -> out (fp16); backward dout, q, k, v -> dq, dk, dv; forward + backward
(timed together): the sum. GB/s = bytes / median time, % of a same-size copy (a uint8 copy
moving those bytes, timed once per byte count), TFLOP/s of the real rows' causal attention
(_common.causal_attention_flops: forward 4 H L^2 D / 2 per row of L tokens, backward 2.5x the
forward), not counting what the padded paths also compute on pad positions.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels._common import (ATTN_BWD_OVER_FWD, bench_args, causal_attention_flops,  # noqa: E402
                                   fwd_and_fwd_bwd_rates, median_ms, nbytes, print_stock_vs_ours, profile_call,
                                   profile_cells)
from solution.step import attention, packing  # noqa: E402

HQ, HKV, D = 12, 2, 128


class _Attn(torch.nn.Module):
    num_key_value_groups = HQ // HKV


IMPLS = ("stock", "ours", "varlen")


def run_case(lengths, seqlen, impl: str):
    os.environ[attention.LAYOUT_KERNELS_ENV] = "0" if impl == "stock" else "1"
    os.environ[attention.VARLEN_ENV] = "1" if impl == "varlen" else "0"
    info = packing.make_unpadded(lengths, seqlen, torch.device("cuda"))
    n = sum(lengths)
    torch.manual_seed(0)
    q = torch.randn(1, n, HQ, D, device="cuda").transpose(1, 2).requires_grad_()
    k = torch.randn(1, n, HKV, D, device="cuda").transpose(1, 2).requires_grad_()
    v = torch.randn(1, n, HKV, D, device="cuda").transpose(1, 2).requires_grad_()
    g = torch.randn(1, n, HQ, D, device="cuda", dtype=torch.float16)
    mod = _Attn()

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            attention.sdpa_unpadded(mod, q, k, v, info, scaling=D ** -0.5)

    def fwd_bwd():
        with packing.running_unpadded(info), torch.autocast("cuda", dtype=torch.float16):
            out, _ = attention.sdpa_unpadded(mod, q, k, v, info, scaling=D ** -0.5)
        out.backward(g)

    for t in (q, k, v):
        t.grad = None
    fwd_bwd()
    grads = [t.grad.clone() for t in (q, k, v)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        out, _ = attention.sdpa_unpadded(mod, q, k, v, info, scaling=D ** -0.5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    res = {"impl": impl, "tokens": n, "seqlen": seqlen,
           "fwd_ms": median_ms(fwd), "fwd_bwd_ms": median_ms(fwd_bwd, grad_to_none=[q, k, v]),
           "saved_for_bwd_MiB": float("nan"), "peak_fwd_bwd_MiB": peak,
           "fwd_bwd_profile": profile_call(fwd_bwd, reset=(q, k, v))}
    flops = causal_attention_flops(lengths, HQ, D)
    # fwd: q, k, v -> out; bwd: dout, q, k, v -> dq, dk, dv (q's, k's, v's shapes and dtypes)
    fwd_and_fwd_bwd_rates(res, nbytes(q, k, v, out), nbytes(g, q, k, v, q, k, v), flops, ATTN_BWD_OVER_FWD * flops)
    return res, out.float(), grads


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results = []
    for lengths, seqlen in (([512, 300, 180, 60], 512), ([512] * 4, 512)):
        (stock, out_s, g_s), *others = [run_case(lengths, seqlen, impl) for impl in IMPLS]
        for res, out_o, g_o in others:
            res["max_abs_diff_out"] = float((out_s - out_o).abs().max())
            res["max_rel_diff_grads"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(g_o, g_s))
        results += [stock] + [res for res, _, _ in others]
    os.environ.pop(attention.LAYOUT_KERNELS_ENV, None)
    os.environ.pop(attention.VARLEN_ENV, None)
    print(f"GPU: {torch.cuda.get_device_name()}\n")
    print_stock_vs_ours(results, [("impl", "impl"), ("tokens", "tokens"), ("seqlen", "seqlen")], group=len(IMPLS))
    print("\n| impl | tokens | host ms | GPU ops | GPU ms | our launches | out max abs diff | grads max rel diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        p = r["fwd_bwd_profile"]
        print(f"| {r['impl']} | {r['tokens']} | {profile_cells(p)} | "
              f"{r.get('max_abs_diff_out', '')} | {r.get('max_rel_diff_grads', '')} |")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
