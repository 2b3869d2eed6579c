"""GPU benchmark: peft's LoRA-on-NF4 layer (lora.bnb.Linear4bit: q_proj, v_proj) stock vs ours,
forward and forward + backward, under torch.autocast(fp16) as in training.

    python bench/kernels/bench_lora.py --out lora.json

Shapes: x [4, 512, 1536] (2048 tokens) and [3, 500, 1536] (1500 tokens), fp32 activations (the
fp32 residual stream after RMSNorm); q_proj [1536, 1536] and v_proj [256, 1536], NF4 with double
quantization, fp32 bias (after prepare_model_for_kbit_training); LoRA r=16, alpha=32 with fp32
adapter weights (what Soup leaves on an fp16 card) and bf16 (trl's cast on bf16 cards); dropout
0.05 (Soup's default) and 0. Stock = peft's forward with bnb's Linear4bit forward; ours = the
patched forward (one autograd Function). Median times (triton.testing.do_bench), the peak
memory of one forward + backward above the baseline, and per forward + backward: host (CPU) time
to issue it, GPU work items and their summed GPU time (torch.profiler), our Triton launches.
Rates (bench/kernels/_common.py, rates): bytes that must move = every input read once + every
output written once, forward: x, the NF4 weight (packed codes + quantization state), bias,
LoRA A, B -> y; backward: dy, x, the NF4 weight, A, B -> dx, dA, dB (the base weight is frozen; the
dropout mask is left out, it can be drawn again from its seed); forward + backward (timed
together): the sum; GB/s = bytes / median time, % of a same-size copy (a uint8 copy moving those
bytes, timed here once per byte count), and TFLOP/s from the matmuls' FLOPs (2 M N K each;
T tokens, r = 16): forward 2 T in out + 2 T r (in + out), backward (dx, dA, dB)
2 T in out + 4 T r (in + out).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import (_x, autocast_fwd_and_fwd_bwd, bench_args, fwd_and_fwd_bwd_rates,  # noqa: E402
                                   median_ms, nbytes, nf4_weight_tensors, profile_call, profile_cells, rate_cells)

HIDDEN = 1536
RANK = 16
PROJ = {"q_proj": 1536, "v_proj": 256}
TOKENS = [(4, 512), (3, 500)]
CASES = [(0.05, torch.float32), (0.0, torch.float32), (0.05, torch.bfloat16)]




def make_layer(out_f, dropout, lora_dtype):
    import bitsandbytes as bnb
    from peft import LoraConfig
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    base = bnb.nn.Linear4bit(HIDDEN, out_f, bias=True, compute_dtype=torch.float16, compress_statistics=True,
                             quant_type="nf4")
    base.weight = bnb.nn.Params4bit((torch.randn(out_f, HIDDEN) * 0.02).half(), requires_grad=False,
                                    compress_statistics=True, quant_type="nf4")
    base.bias = torch.nn.Parameter(torch.randn(out_f) * 0.1, requires_grad=False)
    base = base.cuda()
    cfg = LoraConfig(r=RANK, lora_alpha=32, lora_dropout=dropout, target_modules=["q_proj"], bias="none")
    layer = LoraLinear4bit(base, "default", config=cfg, r=RANK, lora_alpha=32)
    for lin in (layer.lora_A["default"], layer.lora_B["default"]):
        lin.weight = torch.nn.Parameter((torch.randn(lin.weight.shape) * 0.02).to("cuda", lora_dtype))
    return layer.train()


def _bytes_and_flops(layer, x, g, y):
    """(fwd bytes, bwd bytes, fwd FLOPs, bwd FLOPs) that the layer must move / do (module doc)."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w4 = nf4_weight_tensors(layer.base_layer.weight)
    fwd_bytes = nbytes(x, *w4, layer.base_layer.bias, a, b, y)
    bwd_bytes = nbytes(g, x, *w4, a, b, x, a, b)  # reads, then dx, dA, dB written
    t, out_f = x.numel() // HIDDEN, g.shape[-1]
    lora = 2 * t * RANK * (HIDDEN + out_f)
    return fwd_bytes, bwd_bytes, 2 * t * HIDDEN * out_f + lora, 2 * t * HIDDEN * out_f + 2 * lora


def bench_case(proj, out_f, tokens, dropout, lora_dtype):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from solution.patches.peft_lora_bnb import make_forward

    torch.manual_seed(0)
    layer = make_layer(out_f, dropout, lora_dtype)
    stock_forward = LoraLinear4bit.__dict__["forward"]  # this script never calls apply()
    ours_forward = make_forward(stock_forward)
    fns = {"stock": lambda t: stock_forward(layer, t), "ours": lambda t: ours_forward(layer, t)}
    x = torch.randn(*tokens, HIDDEN, device="cuda", requires_grad=True)
    g = torch.randn(*tokens, out_f, device="cuda")
    params = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    rows = []
    for impl, fn in fns.items():
        fwd, fwd_bwd = autocast_fwd_and_fwd_bwd(fn, x, g)

        t_f, t_fb = median_ms(fwd), median_ms(fwd_bwd, grad_to_none=params)
        prof = profile_call(fwd_bwd, reset=params)
        torch.cuda.synchronize()
        base_mem = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
        for p in params:
            p.grad = None
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            y = fn(x)
        rows.append(fwd_and_fwd_bwd_rates(
            {"proj": proj, "tokens": tokens[0] * tokens[1], "dropout": dropout,
             "lora_dtype": str(lora_dtype).split(".")[-1], "impl": impl, "fwd_ms": t_f,
             "fwd_bwd_ms": t_fb, "peak_fwd_bwd_MiB": peak, "fwd_bwd_profile": prof},
            *_bytes_and_flops(layer, x, g, y)))
        del y
    # guard: same work (same seed -> same dropout mask)
    outs = {}
    for impl, fn in fns.items():
        torch.manual_seed(1)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            outs[impl] = fn(x)
    rows[-1]["fwd_equal_to_stock"] = torch.equal(outs["ours"], outs["stock"])
    rows[-1]["speedup_fwd_bwd"] = rows[0]["fwd_bwd_ms"] / rows[1]["fwd_bwd_ms"]
    return rows


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results = []
    for proj, out_f in PROJ.items():
        for tokens in TOKENS:
            for dropout, lora_dtype in CASES:
                results += bench_case(proj, out_f, tokens, dropout, lora_dtype)
    print(f"GPU: {torch.cuda.get_device_name()}\n")
    print("| proj | tokens | dropout | LoRA dtype | impl | fwd ms | fwd+bwd ms | peak fwd+bwd MiB | speedup fwd+bwd |"
          " fwd equal | fwd+bwd: host ms | GPU ops | GPU ms | our launches | fwd GB/s | fwd % of a same-size copy |"
          " fwd TFLOP/s | fwd+bwd GB/s | fwd+bwd % of a same-size copy | fwd+bwd TFLOP/s |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"
          " ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        p = r["fwd_bwd_profile"]
        print(f"| {r['proj']} | {r['tokens']} | {r['dropout']} | {r['lora_dtype']} | {r['impl']} | {r['fwd_ms']:.4f} | "
              f"{r['fwd_bwd_ms']:.4f} | {r['peak_fwd_bwd_MiB']:.1f} | {_x(r.get('speedup_fwd_bwd'))} | "
              f"{r.get('fwd_equal_to_stock', '')} | {profile_cells(p)} | "
              + " | ".join(rate_cells(r, "fwd_", True) + rate_cells(r, "fwd_bwd_", True)) + " |")
    print("\n(host ms: CPU time to issue one forward + backward with the GPU idle; when it is above the GPU ms,"
          " the call is host-bound and the do_bench time follows the host time)")
    with open(args.out, "w") as f:
        json.dump({"op": "lora_nf4", "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
