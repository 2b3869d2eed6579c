"""GPU benchmark: stock apply_rotary_pos_emb vs solution's Triton RoPE (q and k in one launch).

    python bench/kernels/bench_rope.py --out rope.json

Shapes as in Qwen2.5-1.5B's attention: q [4, 12, L, 128] and k [4, 2, L, 128] as views of the
projections' outputs ([4, L, H*128] -> view -> transpose: non-contiguous), cos/sin [1, L, 128]
(Qwen2Model builds position_ids of shape [1, L] when the collator passes none, as trl's does without
padding-free). L = 512 (4 x 512 = 2048 tokens) and 375 (~1500 tokens). Dtypes: fp32 everywhere (the
workload: bitsandbytes' Linear4bit returns its input's dtype, and the input is the fp32 normed
residual) and fp16 q/k with fp32 cos/sin. Reports median fwd and fwd+bwd times (do_bench),
the memory the forward keeps for backward, and the peak memory of fwd + bwd.
Rates (bench/kernels/_common.py, rates): bytes that must move = every input read once + every
output written once, forward: q, k, cos, sin -> q_rot, k_rot; backward: dq_rot, dk_rot, cos, sin
-> dq, dk; forward + backward (timed together): the sum; GB/s = bytes / median time and % of a
same-size copy (a uint8 copy moving those bytes, timed here once per byte count).

Then a sweep of the kernel's tokens per program (BLOCK_T = 1, the default on the GPU, and 2 and 4,
with 4 warps per token) at 2048 fp32 tokens, to confirm the launch configuration on the T4.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import (bench_args, fwd_and_fwd_bwd_rates, nbytes,  # noqa: E402
                                   print_stock_vs_ours, rate_cells)
import triton  # noqa: E402

from solution.kernels import rope as rope_mod  # noqa: E402
from solution.kernels.rope import rope  # noqa: E402

B, HQ, HK, D = 4, 12, 2, 128
CASES = [(512, torch.float32, torch.float32), (375, torch.float32, torch.float32),
         (512, torch.float16, torch.float32)]


def _inputs(seq, qk_dtype, cs_dtype):
    q_flat = torch.randn(B, seq, HQ * D, device="cuda", dtype=qk_dtype, requires_grad=True)
    k_flat = torch.randn(B, seq, HK * D, device="cuda", dtype=qk_dtype, requires_grad=True)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.arange(seq, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return q_flat, k_flat, emb.cos().to(cs_dtype), emb.sin().to(cs_dtype)


def _views(q_flat, k_flat, seq):
    return (q_flat.view(B, seq, HQ, D).transpose(1, 2), k_flat.view(B, seq, HK, D).transpose(1, 2))


def _rope_closures(fn, q_flat, k_flat, seq, cos, sin, gq, gk):
    """(fwd, fwd_bwd) for ``fn`` applied to q/k in Qwen2's layout (views of the projection outputs)."""

    def fwd():
        q, k = _views(q_flat, k_flat, seq)
        return fn(q, k, cos, sin)

    def fwd_bwd():
        qo, ko = fwd()
        torch.autograd.backward((qo, ko), (gq, gk))

    return fwd, fwd_bwd


def _bytes(q_flat, k_flat, cos, sin, gq, gk):
    """(forward, backward) bytes that must move: q, k, cos, sin -> q_rot, k_rot (gq / gk's shapes
    and dtypes); dq_rot, dk_rot, cos, sin -> dq, dk (q / k's)."""
    return nbytes(q_flat, k_flat, cos, sin, gq, gk), nbytes(gq, gk, cos, sin, q_flat, k_flat)


def _time_fwd_and_fwd_bwd(fwd, fwd_bwd, q_flat, k_flat):
    """Median ms of the forward (no grad) and of forward + backward."""
    with torch.no_grad():
        t_fwd = triton.testing.do_bench(fwd, warmup=10, rep=50, return_mode="median")
    t_fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=[q_flat, k_flat],
                                   return_mode="median")
    return t_fwd, t_fb


def bench_case(seq, qk_dtype, cs_dtype):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as stock  # never patched here

    torch.manual_seed(0)
    q_flat, k_flat, cos, sin = _inputs(seq, qk_dtype, cs_dtype)
    out_dtype = torch.promote_types(qk_dtype, cs_dtype)
    gq = torch.randn(B, HQ, seq, D, device="cuda", dtype=out_dtype)
    gk = torch.randn(B, HK, seq, D, device="cuda", dtype=out_dtype)
    fns = {"stock": stock, "ours": rope}
    rows = []
    for name, fn in fns.items():
        fwd, fwd_bwd = _rope_closures(fn, q_flat, k_flat, seq, cos, sin, gq, gk)
        t_fwd, t_fb = _time_fwd_and_fwd_bwd(fwd, fwd_bwd, q_flat, k_flat)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        qo, ko = fwd()
        out_bytes = (qo.numel() + ko.numel()) * qo.element_size()
        kept = torch.cuda.memory_allocated() - base - out_bytes
        torch.autograd.backward((qo, ko), (gq, gk))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        q_flat.grad = k_flat.grad = None
        del qo, ko
        row = {"impl": name, "tokens": B * seq, "qk_dtype": str(qk_dtype).split(".")[-1],
               "cos_dtype": str(cs_dtype).split(".")[-1], "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
               "saved_for_bwd_MiB": kept / 2**20, "peak_fwd_bwd_MiB": peak / 2**20}
        rows.append(fwd_and_fwd_bwd_rates(row, *_bytes(q_flat, k_flat, cos, sin, gq, gk)))
    with torch.no_grad():  # correctness guard: ours must equal stock bit for bit
        q, k = _views(q_flat, k_flat, seq)
        a, b = rope(q, k, cos, sin), stock(q, k, cos, sin)
        rows[1]["bit_equal_to_stock"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    return rows


def sweep_tokens_per_program(seq=512):
    """fwd and fwd+bwd time of our kernel for each GPU tile budget (BLOCK_T 1, 2, 4), fp32."""
    torch.manual_seed(0)
    q_flat, k_flat, cos, sin = _inputs(seq, torch.float32, torch.float32)
    gq = torch.randn(B, HQ, seq, D, device="cuda")
    gk = torch.randn(B, HK, seq, D, device="cuda")
    default = rope_mod.GPU_TILE_ELEMS
    rows = []
    try:
        for tile in (default,) + tuple(rope_mod.BENCH_GPU_TILE_ELEMS):
            rope_mod.GPU_TILE_ELEMS = tile
            block_t = rope_mod._launch_config(B * seq, HQ, HK, D)["BLOCK_T"]

            fwd, fwd_bwd = _rope_closures(rope, q_flat, k_flat, seq, cos, sin, gq, gk)
            t_fwd, t_fb = _time_fwd_and_fwd_bwd(fwd, fwd_bwd, q_flat, k_flat)
            row = {"gpu_tile_elems": tile, "block_t": block_t, "default": tile == default,
                   "tokens": B * seq, "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb}
            rows.append(fwd_and_fwd_bwd_rates(row, *_bytes(q_flat, k_flat, cos, sin, gq, gk)))
    finally:
        rope_mod.GPU_TILE_ELEMS = default
    return rows


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results = []
    for seq, qk_dtype, cs_dtype in CASES:
        results += bench_case(seq, qk_dtype, cs_dtype)
    print(f"GPU: {torch.cuda.get_device_name()}\n")
    print_stock_vs_ours(results, [("impl", "impl"), ("tokens", "tokens"), ("q/k", "qk_dtype"), ("cos/sin", "cos_dtype")])
    print("\nours bit-equal to stock:", [r.get("bit_equal_to_stock") for r in results if r["impl"] == "ours"])
    sweep = sweep_tokens_per_program()
    print("\nTokens per program (ours, fp32, 2048 tokens):\n")
    print("| BLOCK_T | GPU_TILE_ELEMS | default | fwd ms | fwd+bwd ms | fwd GB/s | fwd % of a same-size copy |"
          " fwd+bwd GB/s | fwd+bwd % of a same-size copy |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in sweep:
        print(f"| {r['block_t']} | {r['gpu_tile_elems']} | {'yes' if r['default'] else ''} | {r['fwd_ms']:.4f} | "
              f"{r['fwd_bwd_ms']:.4f} | " + " | ".join(rate_cells(r, "fwd_") + rate_cells(r, "fwd_bwd_")) + " |")
    with open(args.out, "w") as f:
        json.dump({"op": "rope", "gpu": torch.cuda.get_device_name(), "shape": {"B": B, "Hq": HQ, "Hk": HK, "D": D},
                   "results": results, "tokens_per_program_sweep": sweep}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
