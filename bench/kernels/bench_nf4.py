"""GPU benchmark: NF4 dequantization, ours vs bitsandbytes, at Qwen2.5-1.5B's weight shapes.

    python bench/kernels/bench_nf4.py --out nf4.json

Dequantization of one weight (double quantization on, fp16 out): bnb's ``dequantize_4bit``
(2 launches + a temporary scale tensor + an add, fresh output) vs our single kernel into a reused
buffer (a prepared ``DequantPlan``, as the layers use it), and the fused launch (dequant + fp16
cast of 2048 fp32 activation rows) vs dequant then torch's cast.
Effective bandwidth = bytes that must move (packed codes n/2 + uint8 scales n/64 + fp16 output
2n) / time, also as % of a device-to-device copy measured here (a 512 MiB copy, and a copy
moving the same bytes as the dequantization, the fair ceiling at 1-35 MB) and of the nominal DRAM
bandwidth when torch reports the memory clock. A small sweep over our
kernel's launch configuration (blocks per program, warps) shows
whether the default is best (a configuration that is not bit-exact is reported as NaN).
Rates (bench/kernels/_common.py, rates): GB/s = bytes / median time and % of a same-size copy
(timed once per byte count).
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import _x, bench_args, median_ms, rates  # noqa: E402
import triton  # noqa: E402

SHAPES = {"q_proj/o_proj": (1536, 1536), "k_proj/v_proj": (256, 1536), "gate/up_proj": (8960, 1536),
          "down_proj": (1536, 8960)}
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


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    copy_gbs, nominal_gbs = copy_bandwidth_gbs(), nominal_bandwidth_gbs()
    deq = bench_dequant(copy_gbs, nominal_gbs)
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
    with open(args.out, "w") as f:
        json.dump({"op": "nf4", "gpu": torch.cuda.get_device_name(), "copy_GB_s": copy_gbs,
                   "nominal_GB_s": nominal_gbs, "dequant": deq}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
