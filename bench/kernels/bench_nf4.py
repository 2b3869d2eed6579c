"""GPU benchmark: NF4 dequantization (ours vs bitsandbytes) and the frozen NF4 linear forward +
backward (ours vs bnb's Linear4bit), at Qwen2.5-1.5B's weight shapes.

    python bench/kernels/bench_nf4.py --out nf4.json

Part 1, dequantization of one weight (double quantization on, fp16 out): bnb's
``dequantize_4bit`` (2 launches + a temporary scale tensor + an add, fresh output) vs our single
kernel into a reused buffer (a prepared ``DequantPlan``, as the layers use it), and the fused
launch (dequant + fp16 cast of 2048 fp32 activation rows) vs dequant then torch's cast.
Effective bandwidth = bytes that must move (packed codes n/2 + uint8 scales n/64 + fp16 output
2n) / time, also as % of a device-to-device copy measured here (a 512 MiB copy, and a copy
moving the same bytes as the dequantization, the fair ceiling at 1-35 MB) and of the nominal DRAM
bandwidth when torch reports the memory clock. A small sweep over our
kernel's launch configuration (blocks per program, warps) shows
whether the default is best (a configuration that is not bit-exact is reported as NaN).
Part 2, Linear4bit forward and forward + backward (input grad only: frozen weight) under
torch.autocast(fp16) with fp32 activations as in training, tokens 4 x 512 = 2048 and 3 x 500 =
1500: stock bnb forward vs our patched forward; median times (triton.testing.do_bench), the
peak memory of one forward + backward above the baseline, and per forward + backward: host
(CPU) time to issue it, number of GPU work items and their summed GPU time (torch.profiler),
number of our Triton launches. At these sizes an H200 finishes the kernels faster than Python
issues them, so the host time is what decides there.
Rates of both parts (bench/kernels/_common.py, rates): GB/s = bytes / median time and % of a
same-size copy (timed once per byte count); for the linear, bytes forward x, the NF4 weight
(packed codes + quantization state), bias -> y, backward dy, the NF4 weight -> dx, forward +
backward (timed together) the sum, and TFLOP/s from 2 T in out FLOPs per pass (T tokens).
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import (_x, autocast_fwd_and_fwd_bwd, bench_args, fwd_and_fwd_bwd_rates,  # noqa: E402
                                   median_ms, nbytes, nf4_weight_tensors, profile_call, profile_cells, rate_cells,
                                   rates)
import triton  # noqa: E402

SHAPES = {"q_proj/o_proj": (1536, 1536), "k_proj/v_proj": (256, 1536), "gate/up_proj": (8960, 1536),
          "down_proj": (1536, 8960)}
TOKENS = [(4, 512), (3, 500)]
# (blocks of 64 per program, warps)
SWEEP = [(32, 4), (64, 4), (128, 4), (128, 8), (256, 8)]




def copy_bandwidth_gbs() -> float:
    """A device-to-device copy of 512 MiB: read + write bytes / time (an achievable reference)."""
    a = torch.empty(256 * 2**20, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    t = median_ms(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / (t * 1e-3) / 1e9


def nominal_bandwidth_gbs() -> float | None:
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # DDR: two transfers per clock


def bench_dequant(copy_gbs, nominal_gbs):
    import bitsandbytes.functional as bnbF

    from solution.kernels import nf4_dequant as nd

    rows = []
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        w = (torch.randn(shape, device="cuda") * 0.02).half()
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        n = math.prod(shape)
        buf = torch.empty(shape, dtype=torch.float16, device="cuda")
        ours = nd.dequantize_nf4(packed, qs, out=buf)
        ref = bnbF.dequantize_4bit(packed, qs)
        exact = torch.equal(ours.view(torch.int16), ref.view(torch.int16))
        n_bytes = n // 2 + n // 64 + 2 * n
        t_bnb = median_ms(lambda: bnbF.dequantize_4bit(packed, qs))
        plan = nd.DequantPlan(packed, qs)  # what the layers use: prepared once, one launch per call
        t_ours = median_ms(lambda: plan.launch(buf))
        # the fused launch of the NF4 linear: dequant + fp16 cast of 2048 fp32 activation rows,
        # vs the same dequant followed by torch's cast
        x = torch.randn(2048, shape[1], device="cuda")
        x16 = torch.empty(x.shape, dtype=torch.float16, device="cuda")
        plan.launch(buf, a=x, a16=x16)
        fused_ok = torch.equal(x16, x.half()) and torch.equal(buf.view(torch.int16), ref.view(torch.int16))
        t_fused = median_ms(lambda: plan.launch(buf, a=x, a16=x16)) if fused_ok else float("nan")
        t_separate = median_ms(lambda: (plan.launch(buf), x.to(torch.float16)))
        # why the fused launch can lose: its cast programs alone (dequant=False), per cast block
        cast_sweep = {"torch_cast": median_ms(lambda: x.to(torch.float16))}
        default_block = plan.cast_block
        for cb in (1024, 2048, 4096, 8192):
            plan.cast_block = cb
            cast_sweep[f"cast_only_CB{cb}"] = median_ms(lambda: plan.launch(buf, dequant=False, a=x, a16=x16))
            cast_sweep[f"fused_CB{cb}"] = median_ms(lambda: plan.launch(buf, a=x, a16=x16))
        plan.cast_block = default_block
        sweep = {}
        lut = nd._nf4_lut(packed.device)
        for nb, warps in SWEEP:
            grid = (triton.cdiv(n // 64, nb),)

            def launch(nb=nb, warps=warps, grid=grid):
                nd.nf4_dequant_kernel[grid](packed, qs.absmax, qs.state2.code, qs.state2.absmax, qs.offset, lut,
                                            buf, n, n // 2, n // 64, BLOCKSIZE=64, NESTED=True, NESTED_BS=256,
                                            NB=nb, ROUND_BF16=False, num_warps=warps, enable_fp_fusion=False)

            launch()
            ok = torch.equal(buf.view(torch.int16), ref.view(torch.int16))
            sweep[f"NB{nb}_w{warps}"] = median_ms(launch) if ok else float("nan")
        for impl, t in (("bnb dequantize_4bit", t_bnb), ("ours", t_ours)):
            # bytes, GB_s, and against a device-to-device copy moving the same bytes (half read, half
            # written): at these sizes (1-35 MB) a copy does not reach the 512 MiB copy's bandwidth either
            r = rates(n_bytes, t)
            rows.append({"weight": name, "shape": list(shape), "impl": impl, "ms": t, **r,
                         "pct_of_copy": 100 * r["GB_s"] / copy_gbs,
                         "pct_of_nominal": None if nominal_gbs is None else 100 * r["GB_s"] / nominal_gbs})
        rows[-1]["bit_exact_vs_bnb"] = exact
        rows[-1]["speedup"] = t_bnb / t_ours
        rows[-1]["sweep_ms"] = sweep
        rows[-1]["dequant_plus_cast_2048_ms"] = {"fused": t_fused, "separate": t_separate}
        rows[-1]["cast_block_sweep_ms"] = cast_sweep
    return rows


def _make_linear(in_f, out_f, bias):
    import bitsandbytes as bnb

    lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=torch.float16, compress_statistics=True,
                            quant_type="nf4")
    lin.weight = bnb.nn.Params4bit((torch.randn(out_f, in_f) * 0.02).half(), requires_grad=False,
                                   compress_statistics=True, quant_type="nf4")
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(out_f) * 0.1, requires_grad=False)  # fp32, as after k-bit prep
    return lin.cuda().train()


def _peak(fn, x, g):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(x).backward(g)
    torch.cuda.synchronize()
    x.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_linear():
    import bitsandbytes as bnb

    from solution.patches.bnb_linear4bit import make_forward

    stock_forward = bnb.nn.Linear4bit.__dict__["forward"]  # this script never calls apply()
    ours_forward = make_forward(stock_forward)
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        torch.manual_seed(0)
        layer = _make_linear(in_f, out_f, bias=name.startswith(("q", "k")))
        for tokens in TOKENS:
            x = torch.randn(*tokens, in_f, device="cuda", requires_grad=True)
            g = torch.randn(*tokens, out_f, device="cuda")
            fns = {"stock": lambda t: stock_forward(layer, t), "ours": lambda t: ours_forward(layer, t)}
            res = {}
            for impl, fn in fns.items():
                fwd, fwd_bwd = autocast_fwd_and_fwd_bwd(fn, x, g)

                def ac(fn=fn):
                    def run(t):
                        with torch.autocast("cuda", dtype=torch.float16):
                            return fn(t)
                    return run

                res[impl] = {"fwd_ms": median_ms(fwd), "fwd_bwd_ms": median_ms(fwd_bwd, grad_to_none=[x]),
                             "peak_fwd_bwd_MiB": _peak(ac(), x, g),
                             "fwd_bwd_profile": profile_call(fwd_bwd, reset=[x])}
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                same = torch.equal(fns["ours"](x), fns["stock"](x))
                y = fns["stock"](x)
            # fwd: x, NF4 weight, bias -> y; bwd: dy, NF4 weight -> dx (frozen weight); 2 M N K FLOPs each
            w4 = nf4_weight_tensors(layer.weight)
            n_tok = tokens[0] * tokens[1]
            fwd_b, bwd_b, flops = nbytes(x, *w4, layer.bias, y), nbytes(g, *w4, x), 2 * n_tok * in_f * out_f
            del y
            for impl in ("stock", "ours"):
                rows.append(fwd_and_fwd_bwd_rates({"weight": name, "tokens": n_tok, "impl": impl, **res[impl]},
                                                  fwd_b, bwd_b, flops, flops))
            rows[-1]["fwd_equal_to_stock"] = same
            rows[-1]["speedup_fwd_bwd"] = res["stock"]["fwd_bwd_ms"] / res["ours"]["fwd_bwd_ms"]
    return rows


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    copy_gbs, nominal_gbs = copy_bandwidth_gbs(), nominal_bandwidth_gbs()
    deq = bench_dequant(copy_gbs, nominal_gbs)
    lin = bench_linear()
    print(f"GPU: {torch.cuda.get_device_name()}; device copy {copy_gbs:.0f} GB/s; nominal DRAM "
          f"{'unknown' if nominal_gbs is None else f'{nominal_gbs:.0f} GB/s'}\n")
    print("| weight | impl | ms | GB/s | % of copy | % of a same-size copy | speedup | bit-exact | best sweep config |"
          " + cast of 2048 x rows: fused / separate ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for r in deq:
        best = min(r["sweep_ms"], key=r["sweep_ms"].get) if "sweep_ms" in r else ""
        best = f"{best} {r['sweep_ms'][best]:.4f} ms" if best else ""
        fc = r.get("dequant_plus_cast_2048_ms")
        fc = f"{fc['fused']:.4f} / {fc['separate']:.4f}" if fc else ""
        print(f"| {r['weight']} {tuple(r['shape'])} | {r['impl']} | {r['ms']:.4f} | {r['GB_s']:.0f} | "
              f"{r['pct_of_copy']:.0f}% | {r['pct_of_same_size_copy']:.0f}% | {_x(r.get('speedup'))} | {r.get('bit_exact_vs_bnb', '')} | {best} | {fc} |")
    sweeps = [r for r in deq if r.get("cast_block_sweep_ms")]
    if sweeps:
        keys = list(sweeps[0]["cast_block_sweep_ms"])
        print("\n(fp16 cast of 2048 fp32 rows, ms: torch's cast, our cast programs alone and the fused launch, per cast block)")
        print("| weight | " + " | ".join(keys) + " |")
        print("| --- |" + " ---: |" * len(keys))
        for r in sweeps:
            print(f"| {r['weight']} | " + " | ".join(f"{r['cast_block_sweep_ms'][k]:.4f}" for k in keys) + " |")
    print("\n| weight | tokens | impl | fwd ms | fwd+bwd ms | peak fwd+bwd MiB | speedup fwd+bwd | fwd equal |"
          " fwd+bwd: host ms | GPU ops | GPU ms | our launches | fwd GB/s | fwd % of a same-size copy | fwd TFLOP/s |"
          " fwd+bwd GB/s | fwd+bwd % of a same-size copy | fwd+bwd TFLOP/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
          " ---: | ---: |")
    for r in lin:
        p = r["fwd_bwd_profile"]
        print(f"| {r['weight']} | {r['tokens']} | {r['impl']} | {r['fwd_ms']:.4f} | {r['fwd_bwd_ms']:.4f} | "
              f"{r['peak_fwd_bwd_MiB']:.1f} | {_x(r.get('speedup_fwd_bwd'))} | {r.get('fwd_equal_to_stock', '')} | "
              f"{profile_cells(p)} | " + " | ".join(rate_cells(r, "fwd_", True) + rate_cells(r, "fwd_bwd_", True)) + " |")
    print("\n(host ms: CPU time to issue one forward + backward with the GPU idle; when it is above the GPU ms,"
          " the call is host-bound and the do_bench time follows the host time)")
    with open(args.out, "w") as f:
        json.dump({"op": "nf4", "gpu": torch.cuda.get_device_name(), "copy_GB_s": copy_gbs,
                   "nominal_GB_s": nominal_gbs, "dequant": deq, "linear": lin}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
