"""GPU benchmark: stock Qwen2RMSNorm vs solution's fused Triton RMSNorm at the workload's shapes.

    python bench/kernels/bench_rmsnorm.py --out rmsnorm.json

Shapes: hidden 1536; tokens 4 x 512 = 2048 (a full batch) and 4 x 375 = 1500 (~ a real batch).
Dtypes: x fp32 / weight fp32 (the workload: fp32 residual stream, weight cast to fp32 by peft's
prepare_model_for_kbit_training) and x fp16 / weight fp32. The weight is frozen as in the workload
(no weight gradient). Reports median times (triton.testing.do_bench) for forward and forward +
backward, the memory the forward keeps alive for backward, and the peak memory of fwd + bwd.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import bench_args, print_stock_vs_ours  # noqa: E402
import triton  # noqa: E402

from solution.kernels.rmsnorm import rmsnorm  # noqa: E402

HIDDEN = 1536
EPS = 1e-6
CASES = [((4, 512), torch.float32, torch.float32), ((4, 375), torch.float32, torch.float32),
         ((4, 512), torch.float16, torch.float32)]


def _stock_module(w_dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    m = Qwen2RMSNorm(HIDDEN, eps=EPS).to(device="cuda", dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.1 * torch.randn(HIDDEN, device="cuda"))
    m.weight.requires_grad_(False)  # frozen, as in the workload
    return m


def _memory(fn, x, g):
    """(bytes kept alive by the forward besides its output, peak bytes above baseline of fwd+bwd)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn(x)
    out_bytes = y.numel() * y.element_size()
    kept = torch.cuda.memory_allocated() - base - out_bytes
    y.backward(g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    x.grad = None
    del y
    return kept, peak


def bench_case(shape, x_dtype, w_dtype):
    torch.manual_seed(0)
    m = _stock_module(w_dtype)
    stock_forward = type(m).forward  # the class's own forward (this script never calls apply())
    fns = {"stock": lambda t: stock_forward(m, t), "ours": lambda t: rmsnorm(t, m.weight, EPS)}
    x = torch.randn(*shape, HIDDEN, device="cuda", dtype=x_dtype, requires_grad=True)
    g = torch.randn(*shape, HIDDEN, device="cuda", dtype=torch.promote_types(x_dtype, w_dtype))
    rows = []
    for name, fn in fns.items():
        with torch.no_grad():
            t_fwd = triton.testing.do_bench(lambda: fn(x), warmup=10, rep=50, return_mode="median")

        def fwd_bwd():
            fn(x).backward(g)

        t_fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=[x], return_mode="median")
        kept, peak = _memory(fn, x, g)
        rows.append({"impl": name, "tokens": shape[0] * shape[1], "x_dtype": str(x_dtype).split(".")[-1],
                     "w_dtype": str(w_dtype).split(".")[-1], "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb,
                     "saved_for_bwd_MiB": kept / 2**20, "peak_fwd_bwd_MiB": peak / 2**20})
    # correctness guard: the benchmark must compare equal work
    with torch.no_grad():
        a, b = fns["ours"](x), fns["stock"](x)
        rows[1]["max_abs_diff_vs_stock"] = (a.float() - b.float()).abs().max().item()
    return rows


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results = []
    for shape, x_dtype, w_dtype in CASES:
        results += bench_case(shape, x_dtype, w_dtype)
    print(f"GPU: {torch.cuda.get_device_name()}\n")
    print_stock_vs_ours(results, [("impl", "impl"), ("tokens", "tokens"), ("x", "x_dtype"), ("w", "w_dtype")])
    with open(args.out, "w") as f:
        json.dump({"op": "rmsnorm", "gpu": torch.cuda.get_device_name(), "hidden": HIDDEN, "results": results},
                  f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
