"""GPU benchmark: where the decoder-layer node's host time goes, call by call (one level below
bench_layer_host.py, which times whole layers).

    python bench/kernels/bench_node_sections.py --out node_sections.json

The node variant of bench_layer_host.py (4 layers, graphs off, the same batch). Each function in
``TARGETS`` is wrapped by a timer (two ``perf_counter_ns`` reads and a list append a call, ~0.5 us)
that keeps its inclusive time and its own time (inclusive minus the wrapped calls under it); 20
steps are timed that way. The table gives, per layer (forward + backward), the calls, the inclusive
and the own microseconds of each target; "step, unwrapped" and "step, wrapped" say how much the
timers themselves add. Targets that the code no longer has are listed and skipped. Then a launch
table: one of the node's real launches (``nf4_dequant_cast_kernel`` as q's forward calls it) timed
2,000 times through ``kernel[grid]`` and through ``launch()`` (kernels/_launches.py: the same call,
counted), with the GPU kept busy so that only host time is timed; and a table of the GEMM calls'
host cost as torch is asked for them (F.linear with and without autocast, 3-D / 2-D, bias or not;
torch.matmul, mm, addmm). At one fixed shape they differ by a few us (autocast ~1 us a call); the
cost of a new shape: bench_gemm_shapes.py.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels.bench_layer_host import LAYERS, _timed_ms, build, setup, step_fn  # noqa: E402

STEPS = 20


def targets():
    """(owner, attribute, label): what is wrapped. Functions imported by name into step/layer.py
    are wrapped there (that is where the node looks them up)."""
    import torch.nn.functional as F
    import triton.runtime.jit as jit

    from solution.kernels import (add_rmsnorm, attn_varlen, fp32_add, lora_nf4, nf4_dequant, nf4_mlp, qkv_rope,
                                  rmsnorm)
    from solution.step import layer
    return [
        (jit.JITFunction, "run", "triton JITFunction.run"),
        (F, "linear", "F.linear"), (torch, "matmul", "torch.matmul"), (torch, "mm", "torch.mm"),
        (torch, "empty", "torch.empty"), (torch, "empty_like", "torch.empty_like"),
        (torch, "empty_strided", "torch.empty_strided"),
        (torch.Tensor, "to", "Tensor.to"), (torch.Tensor, "view", "Tensor.view"),
        (torch.Tensor, "reshape", "Tensor.reshape"), (torch.Tensor, "transpose", "Tensor.transpose"),
        (torch.Tensor, "contiguous", "Tensor.contiguous"), (torch.Tensor, "t", "Tensor.t"),
        (layer, "_node_forward", "node forward (ours)"), (layer, "_node_backward", "node backward (ours)"),
        (layer, "_projections16", "_projections16"), (layer, "lora_dropout", "lora_dropout"),
        (layer, "lora_forward_gemms", "lora_forward_gemms"), (layer, "lora_backward_gemms", "lora_backward_gemms"),
        (layer, "_attention", "_attention"), (layer, "_attention_grads", "_attention_grads"),
        (layer, "qkv_grad_sum", "qkv_grad_sum"), (qkv_rope, "forward", "qkv_rope forward"),
        (qkv_rope, "backward", "qkv_rope backward"),
        (attn_varlen, "varlen_forward", "varlen_forward"), (attn_varlen, "varlen_backward", "varlen_backward"),
        (rmsnorm, "_launch_forward", "rmsnorm fwd"),
        (rmsnorm, "_launch_backward_dx", "rmsnorm bwd"), (add_rmsnorm, "_launch_forward", "add_rmsnorm fwd"),
        (add_rmsnorm, "_launch_backward", "add_rmsnorm bwd"), (fp32_add, "add_as_fp32", "add_as_fp32"),
        (nf4_mlp, "mlp_forward", "mlp_forward"), (nf4_mlp, "mlp_backward", "mlp_backward"),
        (nf4_dequant.DequantPlan, "launch", "DequantPlan.launch"),
        (lora_nf4, "cast_pair", "cast_pair"), (layer, "cast_four", "cast_four"),
        # inside lora_dropout: stock's padded draw and the real rows kept (its own time, split)
        (torch, "native_dropout", "torch.native_dropout"), (torch.Tensor, "index_select", "Tensor.index_select"),
    ]


class Timers:
    """Inclusive and own nanoseconds and calls per label, for wrapped callables."""

    def __init__(self):
        self.incl, self.own, self.calls, self.stack, self.saved = {}, {}, {}, [], []

    def wrap(self, owner, name, label):
        orig = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        self.saved.append((owner, name, orig))
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig
        incl, own, calls, stack = self.incl, self.own, self.calls, self.stack
        incl[label] = own[label] = calls[label] = 0
        clock = time.perf_counter_ns

        def timed(*a, **k):
            stack.append(0)
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                dt = clock() - t0
                inner = stack.pop()
                incl[label] += dt
                own[label] += dt - inner
                calls[label] += 1
                if stack:
                    stack[-1] += dt

        setattr(owner, name, staticmethod(timed) if isinstance(orig, staticmethod) else timed)

    def unwrap(self):
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)
        self.saved.clear()


def time_launches(cap: dict, reps: int = 2000) -> dict:
    """The launch of ``cap`` (captured from a real node call) timed through ``kernel[grid]`` and
    through ``launch()``, host only."""
    from solution.kernels import _launches

    jitf, args, kwargs, grid = cap["jit"], cap["args"], cap["kwargs"], cap["grid"]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)

    def busy():
        for _ in range(6):
            a @ a  # ~ms of GPU work: launches below only queue

    rows = {}
    for label in ("kernel[grid]", "launch()", "kernel[grid]"):
        ts = []
        for _ in range(5):
            busy()
            t0 = time.perf_counter_ns()
            if label == "kernel[grid]":
                for _ in range(reps // 5):
                    jitf[grid](*args, **kwargs)
            else:
                for _ in range(reps // 5):
                    _launches.launch(jitf, grid, "bench", *args, **kwargs)
            ts.append((time.perf_counter_ns() - t0) / (reps // 5) / 1e3)
            torch.cuda.synchronize()
        rows.setdefault(label, []).append(statistics.median(ts))
    return {k: statistics.median(v) for k, v in rows.items()}


def time_gemm_calls(n: int = 1000, reps: int = 2000) -> dict:
    """Host us per call of the node's GEMM calls as torch is asked for them (q_proj's shape,
    [1, n, 1536] x [1536, 1536] fp16, bias), under fp16 autocast (the node's forward) and without
    (its backward), 3-D and 2-D: is it autocast, the 3-D input or the bias that makes F.linear cost
    more than torch.matmul in the step? The GPU kept busy, so that only host time is timed."""
    import torch.nn.functional as F

    x = torch.randn(1, n, 1536, device="cuda", dtype=torch.float16)
    w = torch.randn(1536, 1536, device="cuda", dtype=torch.float16)
    b = torch.randn(1536, device="cuda", dtype=torch.float16)
    x2, wt = x.view(n, 1536), w.t()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    calls = {
        "F.linear 3-D + bias, autocast": (True, lambda: F.linear(x, w, b)),
        "F.linear 3-D + bias": (False, lambda: F.linear(x, w, b)),
        "F.linear 3-D, no bias, autocast": (True, lambda: F.linear(x, w)),
        "F.linear 2-D + bias": (False, lambda: F.linear(x2, w, b)),
        "torch.matmul 3-D": (False, lambda: torch.matmul(x, wt)),
        "torch.mm 2-D": (False, lambda: torch.mm(x2, wt)),
        "torch.addmm 2-D": (False, lambda: torch.addmm(b, x2, wt)),
    }
    rows = {}
    for label, (autocast, call) in calls.items():
        ts = []
        for _ in range(5):
            for _ in range(6):
                a @ a  # the GPU busy: the calls below only queue
            with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
                t0 = time.perf_counter_ns()
                for _ in range(reps // 5):
                    call()
                ts.append((time.perf_counter_ns() - t0) / (reps // 5) / 1e3)
            torch.cuda.synchronize()
        rows[label] = statistics.median(ts)
    return rows


def main() -> None:
    ready = setup(__doc__)
    if ready is None:
        return
    args, (ids, mask, labels) = ready
    import triton.runtime.jit as jit

    import solution
    from solution.settings import Settings

    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0"))
    with tempfile.TemporaryDirectory() as tmp:
        model = build(tmp, LAYERS)
        step = step_fn(model, ids, mask, labels)
        for _ in range(5):
            step()
        torch.cuda.synchronize()

        def timed_steps():
            return statistics.median(_timed_ms(step) for _ in range(STEPS))

        plain_ms = timed_steps()
        timers = Timers()
        missing = []
        for owner, name, label in targets():
            if hasattr(owner, name):
                timers.wrap(owner, name, label)
            else:
                missing.append(label)
        for _ in range(2):
            step()
        for d in (timers.incl, timers.own, timers.calls):
            for k in d:
                d[k] = 0
        wrapped_ms = timed_steps()
        timers.unwrap()
        # one real launch of the node, captured, then timed through kernel[grid] and launch()
        cap = {}
        orig = jit.JITFunction.run

        def grab(self, *a, grid, warmup, **kw):
            kernel = orig(self, *a, grid=grid, warmup=warmup, **kw)
            if self.fn.__name__ == "nf4_dequant_cast_kernel" and "jit" not in cap:
                cap.update(jit=self, args=a, kwargs=dict(kw), grid=grid)
            return kernel
        jit.JITFunction.run = grab
        step()
        jit.JITFunction.run = orig
        torch.cuda.synchronize()
        launches = time_launches(cap) if cap else {}
        gemms = time_gemm_calls()
    solution.revert()
    per = STEPS * LAYERS
    rows = sorted(((lab, timers.calls[lab] / per, timers.incl[lab] / per / 1e3, timers.own[lab] / per / 1e3)
                   for lab in timers.calls), key=lambda r: -r[3])
    print(f"step ms ({LAYERS} layers, median of {STEPS}): unwrapped {plain_ms:.2f}, wrapped {wrapped_ms:.2f}")
    print("| target | calls / layer | inclusive us / layer | own us / layer |")
    print("| --- | ---: | ---: | ---: |")
    for lab, c, inc, own in rows:
        print(f"| {lab} | {c:.1f} | {inc:.1f} | {own:.1f} |")
    if missing:
        print(f"\ntargets not in this code (skipped): {', '.join(missing)}")
    print("\n| launch of nf4_dequant_cast_kernel | host us / call |")
    print("| --- | ---: |")
    for k, v in launches.items():
        print(f"| {k} | {v:.2f} |")
    print("\n| GEMM call (q_proj's shape, 1000 tokens) | host us / call |")
    print("| --- | ---: |")
    for k, v in gemms.items():
        print(f"| {k} | {v:.2f} |")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "plain_ms": plain_ms, "wrapped_ms": wrapped_ms,
                   "rows": rows, "missing_targets": missing, "launches": launches, "gemm_calls": gemms},
                  f, indent=1)


if __name__ == "__main__":
    main()
