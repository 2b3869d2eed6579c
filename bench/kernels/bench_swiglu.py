"""GPU benchmark: stock ``F.silu(g) * u`` vs our fused SwiGLU, forward and forward + backward, at
the Qwen2.5-1.5B MLP shape (intermediate 8960) for 2048 tokens (4 x 512) and ~1500 real tokens.

    python bench/kernels/bench_swiglu.py --out swiglu.json

Times are medians of triton.testing.do_bench. Every fwd+bwd variant first clones its inputs (the
in-place backward may only overwrite non-leaf tensors, and each run must start from fresh data),
so the clone time is measured alone and subtracted ("net"). Memory: bytes held between forward
and backward (output + saved tensors) and the peak of one fwd+bwd above what was allocated
before it, both including the clones (identical for all variants). Also reports whether our
output and gradients are bitwise identical to stock on this GPU, and which way the kernels get
fp16 silu here ("compute" in registers or "table", see solution/kernels/swiglu.py).
Rates (bench/kernels/_common.py, rates): bytes that must move = every input read once + every
output written once, forward: g, u -> h; backward: dh, g, u -> dg, du (the same for every
variant: the packed one's [tokens, 2 x 8960] input is g and u side by side); forward + backward:
the sum, against the net (clone subtracted) time; GB/s = bytes / median time and % of a
same-size copy (a uint8 copy moving those bytes, timed here once per byte count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench.kernels._common import fwd_and_fwd_bwd_rates, nbytes, rate_cells  # noqa: E402
import solution.kernels.swiglu as sw  # noqa: E402

INTER = 8960
DEVICE = "cuda"
MB = 2**20


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _memory(fn_fwd, fn_bwd) -> tuple[float, float]:
    """(held after forward, peak of forward + backward), MB above the allocation before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    state = fn_fwd()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    fn_bwd(state)
    del state
    torch.cuda.synchronize()
    return held / MB, (torch.cuda.max_memory_allocated() - base) / MB


def bench_tokens(tokens: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    g0 = (torch.randn(tokens, INTER, device=DEVICE, generator=gen) * 3).half().requires_grad_()
    u0 = torch.randn(tokens, INTER, device=DEVICE, generator=gen).half().requires_grad_()
    dh = torch.randn(tokens, INTER, device=DEVICE, generator=gen).half()
    gu0 = torch.cat([g0.detach(), u0.detach()], dim=1).requires_grad_()

    def make(kind):
        """(forward: returns state, backward(state): returns grads) for one variant."""
        def fwd():
            if kind == "packed":
                gu = gu0.clone()
                return gu, sw.swiglu_packed(gu, inplace_backward=True)
            g, u = g0.clone(), u0.clone()
            if kind == "stock":
                return (g, u), F.silu(g) * u
            return (g, u), sw.swiglu(g, u, inplace_backward=(kind == "ours in-place"))

        def bwd(state):
            inputs, h = state
            return torch.autograd.grad(h, inputs, dh)
        return fwd, bwd

    def clone_only():
        return g0.clone(), u0.clone()

    clone_ms = _bench(clone_only)
    g, u = g0.detach(), u0.detach()
    with torch.no_grad():
        fwd_stock_ms = _bench(lambda: F.silu(g) * u)
        fwd_ours_ms = _bench(lambda: sw.swiglu(g, u))
        h_ref = F.silu(g) * u
        same_fwd = torch.equal(sw.swiglu(g, u), h_ref)

    fs, bs = make("stock")
    grads_ref = bs(fs())
    # fwd: g, u -> h; bwd: dh, g, u -> dg, du (g's and u's shapes and dtypes)
    fwd_bytes, bwd_bytes = nbytes(g0, u0, h_ref), nbytes(dh, g0, u0, g0, u0)
    rows = []
    for kind in ("stock", "ours", "ours in-place", "packed"):
        fwd, bwd = make(kind)
        total_ms = _bench(lambda: bwd(fwd()))
        held, peak = _memory(fwd, bwd)
        grads = bwd(fwd())
        if kind == "packed":
            grads = (grads[0][:, :INTER], grads[0][:, INTER:])
        rows.append(fwd_and_fwd_bwd_rates({
            "tokens": tokens, "variant": kind,
            "fwd_ms": fwd_stock_ms if kind == "stock" else fwd_ours_ms,
            "fwd_bwd_ms": total_ms, "fwd_bwd_net_ms": total_ms - clone_ms, "clone_ms": clone_ms,
            "held_after_fwd_MB": held, "peak_fwd_bwd_MB": peak,
            "bitwise_fwd": True if kind == "stock" else same_fwd,
            "bitwise_grads": all(torch.equal(a, b) for a, b in zip(grads, grads_ref)),
        }, fwd_bytes, bwd_bytes, fwd_bwd_ms_key="fwd_bwd_net_ms"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_swiglu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    mode = sw.silu_mode_name(torch.float16, torch.device("cuda"))
    rows = bench_tokens(2048) + bench_tokens(1500)
    dev = torch.cuda.get_device_name()
    print(f"\nSwiGLU h = silu(g) * u, [tokens, {INTER}] fp16 on {dev}; fp16 silu mode: {mode}\n")
    print("| tokens | variant | fwd ms | fwd+bwd ms (net of clone) | held after fwd MB | peak fwd+bwd MB "
          "| bitwise fwd | bitwise grads | fwd GB/s | fwd % of a same-size copy | fwd+bwd GB/s (net) "
          "| fwd+bwd % of a same-size copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_net_ms']:.3f} "
              f"| {r['held_after_fwd_MB']:.1f} | {r['peak_fwd_bwd_MB']:.1f} | {r['bitwise_fwd']} "
              f"| {r['bitwise_grads']} | " + " | ".join(rate_cells(r, "fwd_") + rate_cells(r, "fwd_bwd_")) + " |")
    with open(args.out, "w") as f:
        json.dump({"op": "swiglu", "device": dev, "silu_mode": mode, "intermediate": INTER,
                   "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
