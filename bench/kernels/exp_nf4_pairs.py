"""Experiment (issue 13.1, not part of the package): an NF4 dequant kernel that stores each packed
byte's two fp16 values as one 32-bit word, against today's kernel (which interleaves the high
and low nibbles' values with tl.join + tl.reshape before a [NB, 64] fp16 store).

Prediction, written before the run: the join/reshape makes Triton convert layouts through
shared memory; without it the byte load [NB, 32] flows straight into the word store [NB, 32].
On the H200, gate/up and down (13.8 M weights, ~35 MB moved): today 0.0189 ms (44% of a 512 MiB
copy's bandwidth) -> ~0.013 ms; and a same-size copy is the fairer ceiling at this size.

    python bench/kernels/exp_nf4_pairs.py
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.kernels._common import median_ms  # noqa: E402

SHAPES = {"q_proj/o_proj": (1536, 1536), "k_proj/v_proj": (256, 1536), "gate/up_proj": (8960, 1536),
          "down_proj": (1536, 8960)}


@triton.jit
def pairs_kernel(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, lut_ptr, out_ptr,
                 n_blocks, NB: tl.constexpr, NESTED_BS: tl.constexpr):
    """Blocks of 64 elements, double quantization, n_elements a multiple of 64 (the model's)."""
    pid = tl.program_id(0)
    blk = pid * NB + tl.arange(0, NB)
    ok = blk < n_blocks
    q = tl.load(absmax_ptr + blk, mask=ok, other=0).to(tl.int32)
    c2 = tl.load(code2_ptr + q)
    a2 = tl.load(absmax2_ptr + blk // NESTED_BS, mask=ok, other=0.0)
    scale = (c2 * a2 + tl.load(offset_ptr))[:, None]
    idx = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = ok[:, None]
    packed = tl.load(packed_ptr + idx, mask=m, other=0).to(tl.int32)
    hi = (tl.load(lut_ptr + (packed >> 4)) * scale).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    lo = (tl.load(lut_ptr + (packed & 15)) * scale).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    word = hi | (lo << 16)  # little-endian: element 2j (high nibble) at the lower address
    out32 = out_ptr.to(tl.pointer_type(tl.uint32))
    tl.store(out32 + idx, word, mask=m)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import bitsandbytes.functional as bnbF

    from solution.kernels import nf4_dequant as nd

    print(f"GPU: {torch.cuda.get_device_name()}")
    print("| weight | bytes moved | same-size copy ms | today ms (% of copy) | pairs best ms (% of copy) | config | bit-exact |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        w = (torch.randn(shape, device="cuda") * 0.02).half()
        packed, qs = bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        n = math.prod(shape)
        nbytes = n // 2 + n // 64 + 2 * n
        ref = bnbF.dequantize_4bit(packed, qs)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = median_ms(lambda: dst.copy_(src))  # moves nbytes: half read, half written
        buf = torch.empty(shape, dtype=torch.float16, device="cuda")
        plan = nd.DequantPlan(packed, qs)
        t_today = median_ms(lambda: plan.launch(buf))
        lut = nd._nf4_lut(packed.device)
        best = None
        for nb, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)):
            out = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
            grid = (triton.cdiv(n // 64, nb),)

            def run(nb=nb, warps=warps, grid=grid, out=out):
                pairs_kernel[grid](packed, qs.absmax, qs.state2.code, qs.state2.absmax, qs.offset, lut, out,
                                   n // 64, NB=nb, NESTED_BS=256, num_warps=warps, enable_fp_fusion=False)

            run()
            exact = torch.equal(out.view(torch.int16), ref.view(torch.int16))
            t = median_ms(run)
            if exact and (best is None or t < best[0]):
                best = (t, f"NB{nb} w{warps}")
            if not exact:
                print(f"  (NB{nb} w{warps}: NOT bit-exact)")
        pct = lambda t: 100 * t_copy / t  # noqa: E731
        bt = f"{best[0]:.4f} ({pct(best[0]):.0f}%)" if best else "none exact"
        print(f"| {name} {shape} | {nbytes / 1e6:.1f} MB | {t_copy:.4f} | {t_today:.4f} ({pct(t_today):.0f}%) | {bt} | "
              f"{best[1] if best else ''} | {best is not None} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
