"""GPU benchmark: the host cost of one cuBLAS GEMM call when its row count M is new, against the same
call at an M already seen (is a new token count per step what makes the eager step's GEMM calls dear?).

    python bench/kernels/bench_gemm_shapes.py --out gemm_shapes.json

Why: in the eager training run (graphs off, H200, cProfile of steps 3-64) F.linear cost ~71 us of
host time a call and torch.matmul ~49 us, against ~21 us and ~19 us for the same calls at one fixed
shape (bench_node_sections.py's GEMM table). The packed step's M is the batch's real-token count,
new at almost every step, while the benchmarks repeat one M. Each of the node's GEMM calls is timed
here, host only (the GPU kept busy with large matmuls so that calls only queue), in four patterns:
- ``fixed``: the same M every call;
- ``new M each call``: M = M0 + i, never seen before (what a new step's first call of a shape sees);
- ``new M every 28 calls``: one new M, then 27 more calls at it (a step: each shape 28 times, once
  per layer);
- ``seen M, cycling``: 64 values of M seen before, in turn.
The same patterns for ``torch.empty`` of [M, 1536] fp16 (the caching allocator's share).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels._common import bench_args  # noqa: E402

H, KV, INTER, R = 1536, 256, 8960, 16


def calls(device):
    """(label, make(M) -> callable): the node's GEMM calls as it makes them, at row count M."""
    import torch.nn.functional as F

    w_q = torch.randn(H, H, device=device, dtype=torch.float16)
    b_q = torch.randn(H, device=device, dtype=torch.float16)
    w_kv = torch.randn(KV, H, device=device, dtype=torch.float16)
    w_g = torch.randn(INTER, H, device=device, dtype=torch.float16)
    w_d = torch.randn(H, INTER, device=device, dtype=torch.float16)
    a16 = torch.randn(R, H, device=device, dtype=torch.float16)
    big = {}

    def rows(m, n, name):  # one buffer per width, sliced: no allocation in the timed call but its output
        t = big.get(name)
        if t is None or t.shape[0] < m:
            t = big[name] = torch.randn(8192, n, device=device, dtype=torch.float16)
        return t[:m]

    def on_rows(call):  # make(M): ``call`` on M rows of the hidden width
        def make(m):
            x = rows(m, H, "h")
            return lambda: call(x)
        return make

    def mm_lora_a_grad(m):  # grad_A = grad_h^T x: M is the reduction
        gh, x = rows(m, R, "r"), rows(m, H, "h")
        return lambda: gh.t().mm(x)

    def empty(m):
        return lambda: torch.empty((m, H), device=device, dtype=torch.float16)

    return [("F.linear q (+bias)", on_rows(lambda x: F.linear(x, w_q, b_q))),
            ("F.linear k", on_rows(lambda x: F.linear(x, w_kv))),
            ("F.linear gate", on_rows(lambda x: F.linear(x, w_g))),
            ("F.linear lora A", on_rows(lambda x: F.linear(x, a16))),
            ("torch.matmul q backward", on_rows(lambda g: torch.matmul(g, w_q))),
            ("torch.matmul down backward", on_rows(lambda g: torch.matmul(g, w_d))),
            ("mm lora A grad (K = M)", mm_lora_a_grad), ("torch.empty [M, 1536]", empty)]


def patterns(start: int, n: int):
    """label -> the list of M a pattern calls with (n calls), from ``start`` up (never seen)."""
    seen = [1000 + 16 * i for i in range(64)]
    return {
        "fixed": [1500] * n,
        "new M each call": [start + i for i in range(n)],
        "new M every 28 calls": [start + n + i // 28 for i in range(n)],
        "seen M, cycling": [seen[i % 64] for i in range(n)],
    }, seen


def time_pattern(make, ms, busy) -> float:
    """Median host us a call over 5 rounds of len(ms) // 5 calls, the GPU busy meanwhile."""
    per = len(ms) // 5
    fns = [make(m) for m in ms]  # built before timing (slicing is not the call's cost)
    ts = []
    for r in range(5):
        busy()
        chunk = fns[r * per:(r + 1) * per]
        t0 = time.perf_counter_ns()
        for f in chunk:
            f()
        ts.append((time.perf_counter_ns() - t0) / per / 1e3)
        torch.cuda.synchronize()
    return statistics.median(ts)


def main() -> None:
    args = bench_args(__doc__)
    if args is None:
        return
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)

    def busy():
        for _ in range(8):
            a @ a

    n = 280
    results = {}
    start = 2101  # above the seen Ms (1000..2008)
    for label, make in calls(dev):
        pats, seen = patterns(start, n)
        start += 2 * n + 7  # every call kind gets Ms no other kind used
        for m in seen + [1500]:  # warm: these Ms are "seen"
            make(m)()
        torch.cuda.synchronize()
        results[label] = {p: time_pattern(make, ms, busy) for p, ms in pats.items()}
    cols = list(next(iter(results.values())))
    print(f"| call (host us / call, {torch.cuda.get_device_name(0)}) | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for label, row in results.items():
        print(f"| {label} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + " |")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
