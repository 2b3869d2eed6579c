"""GPU benchmark of host (CPU) time per launch: what a host-bound step pays per operation.

    python bench/kernels/bench_launch.py --out launch.json

Rows (microseconds of host time per call, median of 7 rounds of 500 calls; the kernels are tiny,
so the GPU keeps up and the wall time is the host's):
- a Triton launch: ``fp32_add_kernel[grid](...)`` (Triton's JITFunction.run; 4 arguments and a
  BLOCK), directly and through solution.kernels._launches.launch (what every launch of ours goes
  through); and the same kernel's compiled launcher called directly (``CompiledKernel.run`` with
  the bound arguments: no argument binding, specialization key or cache lookup), with the stream
  read each call;
- torch.add of two fp16 tensors, torch.empty: what a PyTorch op costs on this host, for scale;
- F.linear fp16 [M, 1536] x [1536, 1536]^T with the same M every call, and with a new M every call
  (packed batches give a new M every step; cuBLAS picks an algorithm per shape).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.kernels._common import bench_args  # noqa: E402
from solution.kernels import _launches  # noqa: E402
from solution.kernels.fp32_add import GPU_BLOCK, GPU_NUM_WARPS, fp32_add_kernel  # noqa: E402


def host_us(fn, calls: int = 500, rounds: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def _direct(kernel, grid, args, kwargs):
    """A function that launches ``kernel`` through its compiled launcher (Triton 3.x
    ``CompiledKernel.run``), the bound arguments (constexprs included, in signature order) fixed,
    the current stream read at each call."""
    compiled = kernel[grid](*args, **kwargs)
    params = list(kernel.signature.parameters.values())
    vals = list(args) + [kwargs.get(p.name, p.default) for p in params[len(args):]]
    g = tuple(grid) + (1,) * (3 - len(grid))
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata

    def call():
        run(g[0], g[1], g[2], torch.cuda.current_stream().cuda_stream, fn, meta, None, None, None, *vals)
    return call


def main() -> None:
    args = bench_args(__doc__)
    if args is None:
        return
    n = 4096
    a = torch.randn(n, device="cuda").half()
    b = torch.randn(n, device="cuda").half()
    out = torch.empty(n, device="cuda")
    grid = (_launches.cdiv(n, GPU_BLOCK),)
    kw = dict(BLOCK=GPU_BLOCK, num_warps=GPU_NUM_WARPS)
    rows = {}
    rows["Triton launch, kernel[grid](...)"] = host_us(lambda: fp32_add_kernel[grid](a, b, out, n, **kw))
    rows["Triton launch through _launches.launch"] = host_us(
        lambda: _launches.launch(fp32_add_kernel, grid, "bench", a, b, out, n, **kw))
    rows["compiled launcher called directly"] = host_us(_direct(fp32_add_kernel, grid, (a, b, out, n), kw))
    rows["torch.add fp16"] = host_us(lambda: torch.add(a, b))
    rows["torch.empty"] = host_us(lambda: torch.empty(n, device="cuda"))
    w = torch.randn(1536, 1536, device="cuda").half()
    x = torch.randn(2048, 1536, device="cuda").half()
    rows["F.linear, same M (1000)"] = host_us(lambda: F.linear(x[:1000], w), calls=200)
    ms = iter(range(600, 2048))
    rows["F.linear, new M each call"] = host_us(lambda: F.linear(x[:next(ms)], w), calls=200)
    print("| call | host us |")
    print("| --- | ---: |")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "host_us": rows}, f, indent=1)


if __name__ == "__main__":
    main()
