"""GPU benchmark: where the decoder-layer node's host time goes, call by call (one level below
bench_layer_host.py, which times whole layers).

    python bench/kernels/bench_node_sections.py --out node_sections.json

The node variant of bench_layer_host.py (4 layers, graphs off, the same batch). Each function in
``TARGETS`` is wrapped by a timer (two ``perf_counter_ns`` reads and a list append a call, ~0.5 us)
that keeps its inclusive time and its own time (inclusive minus the wrapped calls under it); 20
steps are timed that way (launches through the direct path, kernels/_launches.py). Before that,
the step timed with the direct path on and off, in pairs, and with attention's way in and out
through kernels/qkv_rope.py ($SOLUTION_QKV_ROPE) on and off, in pairs, and with prepared launches
(kernels/_launches.launch_prepared) on and off, in pairs, and their native launch
(kernels/_launches.raw_launcher) against the launcher's call, in pairs, and with the MLP's gate and up as one GEMM
($SOLUTION_GATE_UP_GEMM) and q's and v's LoRA A GEMMs batched ($SOLUTION_LORA_BMM) on and off, in pairs
(bench/pairs.py: the arm that runs first alternates; each pair comparison reports the arms' medians,
the median and quartiles of the pairs' differences, how many pairs had the "on" arm faster, and
"no difference shown" where the quartiles straddle zero). The table gives, per layer (forward + backward), the calls, the
inclusive and the own microseconds of each target; "step, unwrapped" and "step, wrapped" say how
much the timers themselves add. Then a launch table: one of the node's real launches
(``nf4_dequant_cast_kernel`` as q's forward calls it) timed 2,000 times through ``kernel[grid]``
and through the compiled kernel's launcher directly (what a launcher that skips Triton's per-call
binding would cost), and Triton's binder alone and with the key and its lookup (the direct path's
share), with the GPU kept busy so that only host time is timed; and a table of the GEMM calls'
host cost as torch is asked for them (F.linear with and without autocast, 3-D / 2-D, bias or not;
torch.matmul, mm, addmm). At one fixed shape they differ by a few us (autocast ~1 us a call); the
cost of a new shape: bench_gemm_shapes.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels.bench_layer_host import LAYERS, _timed_ms, build, setup, step_fn  # noqa: E402
from bench import pairs  # noqa: E402

STEPS = 20


def targets():
    """(owner, attribute, label): what is wrapped. Functions imported by name into step/layer.py
    are wrapped there (that is where the node looks them up)."""
    import torch.nn.functional as F
    import triton.runtime.jit as jit

    from solution.kernels import (add_rmsnorm, attn_layout, attn_varlen, fp32_add, lora_nf4, nf4_dequant,
                                  nf4_mlp, qkv_rope, rmsnorm, rope)
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
        (layer, "_lora_forward", "_lora_forward"), (layer, "lora_dropout", "lora_dropout"),
        (layer, "lora_forward_parts", "lora_forward_parts"), (layer, "lora_backward_parts", "lora_backward_parts"),
        (layer, "lora_forward_gemms", "lora_forward_gemms"), (layer, "lora_backward_gemms", "lora_backward_gemms"),
        (layer, "_attention", "_attention"), (layer, "_attention_grads", "_attention_grads"),
        (layer, "_attention_forward", "_attention_forward"), (layer, "_attention_backward", "_attention_backward"),
        (layer, "qkv_grad_sum", "qkv_grad_sum"), (qkv_rope, "forward", "qkv_rope forward"),
        (qkv_rope, "backward", "qkv_rope backward"),
        (attn_varlen, "varlen_forward", "varlen_forward"), (attn_varlen, "varlen_backward", "varlen_backward"),
        (attn_layout, "_launch_pad", "attn_layout pad"), (attn_layout, "_launch_unpad", "attn_layout unpad"),
        (rope, "_launch", "rope"), (rmsnorm, "_launch_forward", "rmsnorm fwd"),
        (rmsnorm, "_launch_backward_dx", "rmsnorm bwd"), (add_rmsnorm, "_launch_forward", "add_rmsnorm fwd"),
        (add_rmsnorm, "_launch_backward", "add_rmsnorm bwd"), (fp32_add, "add_as_fp32", "add_as_fp32"),
        (nf4_mlp, "mlp_forward", "mlp_forward"), (nf4_mlp, "mlp_backward", "mlp_backward"),
        (nf4_dequant.DequantPlan, "launch", "DequantPlan.launch"),
        (lora_nf4, "lora_combine", "lora_combine"), (lora_nf4, "lora_grad_sum", "lora_grad_sum"),
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
    """The launch of ``cap`` (captured from a real node call) timed both ways, host only."""
    from triton import knobs
    from triton.runtime import driver

    jitf, args, kwargs, grid, kernel = cap["jit"], cap["args"], cap["kwargs"], cap["grid"], cap["k"]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)

    def busy():
        for _ in range(6):
            a @ a  # ~ms of GPU work: launches below only queue

    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    bound = list(args) + [kwargs[p.name] for p in jitf.params[len(args):] if p.name in kwargs]
    dev = driver.active.get_current_device()
    rows = {}
    from solution.kernels import _launches

    binder = jitf.device_caches[dev][4]
    cache = {}

    def key_of():
        bound_, spec, options = binder(*args, **kwargs)
        return (id(jitf), dev, tuple(spec), tuple(options.items()))

    for label in ("kernel[grid]", "direct launcher", "launch(), direct path", "binder only",
                  "binder + key + lookup", "kernel[grid]"):
        ts = []
        for _ in range(5):
            busy()
            t0 = time.perf_counter_ns()
            if label == "kernel[grid]":
                for _ in range(reps // 5):
                    jitf[grid](*args, **kwargs)
            elif label == "launch(), direct path":
                for _ in range(reps // 5):
                    _launches.launch(jitf, grid, "bench", *args, **kwargs)
            elif label == "binder only":
                for _ in range(reps // 5):
                    binder(*args, **kwargs)
            elif label == "binder + key + lookup":
                for _ in range(reps // 5):
                    cache.get(key_of())
            else:
                run, fnc, meta = kernel.run, kernel.function, kernel.packed_metadata
                for _ in range(reps // 5):
                    stream = driver.active.get_current_stream(dev)
                    run(*grid3, stream, fnc, meta, None, knobs.runtime.launch_enter_hook,
                        knobs.runtime.launch_exit_hook, *bound)
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
    from solution import settings as settings_mod
    from solution.kernels import _launches
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

        def paired(on: str, off: str, switch, diff: str) -> dict:
            """The step timed with ``switch(True)`` (arm ``on``) and ``switch(False)`` (arm ``off``)
            in STEPS pairs, the arm that goes first alternating (bench/pairs.py); the medians of each
            arm and of the pairs' differences, their quartiles, how many pairs had ``on`` faster, and
            the verdict (a difference whose quartiles straddle zero is not shown), in rows labelled
            ``diff`` (e.g. "qkv_rope on - off") and what each is. Leaves the switch on."""
            times = {True: [], False: []}
            for i in range(STEPS):
                for state in pairs.order(i):
                    switch(state)
                    times[state].append(_timed_ms(step))
            switch(True)
            s = pairs.summary(times[True], times[False])
            return {on: s["on"], off: s["off"], f"{diff}, median of pairs": s["diff"],
                    f"{diff}, quartiles of pairs": f"{s['q1']:.2f} / {s['q3']:.2f}",
                    f"{diff}, pairs with {on} faster": f"{s['on_faster']} of {s['n']}: {pairs.verdict(s)}"}

        def set_prepared(on: bool) -> None:
            _launches._state["prepared"] = on

        on_settings = settings_mod.current()
        direct_rows = paired("direct", "kernel[grid]", _launches.set_direct, "direct - kernel[grid]")
        # attention's way in and out through kernels/qkv_rope.py ($SOLUTION_QKV_ROPE) or the launches
        # it replaces (the node reads the setting once per step)
        direct_rows.update(paired("qkv_rope on", "qkv_rope off",
                                  lambda on: settings_mod.activate(dataclasses.replace(on_settings, qkv_rope=on)),
                                  "qkv_rope on - off"))
        # prepared launches (kernels/_launches.launch_prepared) or launch()
        direct_rows.update(paired("prepared on", "prepared off", set_prepared, "prepared on - off"))

        def set_raw(on: bool) -> None:
            _launches._state["raw"] = on

        # a prepared launch through the launcher's native launch (kernels/_launches.raw_launcher) or its __call__
        direct_rows.update(paired("native launch", "launcher call", set_raw, "native launch - launcher call"))
        # the MLP's gate and up as one GEMM ($SOLUTION_GATE_UP_GEMM: each layer's plan keeps it) and q's
        # and v's LoRA A GEMMs batched ($SOLUTION_LORA_BMM: the node reads it once per step)
        from solution.step import layer as layer_mod

        plans = [p for p in layer_mod._PLANS.values() if isinstance(p, layer_mod.LayerPlan)]
        applies = {id(p): p.gate_up for p in plans}

        def set_gate_up(on: bool) -> None:
            for p in plans:
                p.gate_up = on and applies[id(p)]

        if any(applies.values()):
            direct_rows.update(paired("gate_up on", "gate_up off", set_gate_up, "gate_up on - off"))
        direct_rows.update(paired("lora_bmm on", "lora_bmm off",
                                  lambda on: settings_mod.activate(dataclasses.replace(on_settings, lora_bmm=on)),
                                  "lora_bmm on - off"))
        plain_ms = timed_steps()
        timers = Timers()
        for owner, name, label in targets():
            timers.wrap(owner, name, label)
        for _ in range(2):
            step()
        for d in (timers.incl, timers.own, timers.calls):
            for k in d:
                d[k] = 0
        wrapped_ms = timed_steps()
        timers.unwrap()
        # one real launch of the node, captured, then timed both ways
        cap = {}
        orig = jit.JITFunction.run

        def grab(self, *a, grid, warmup, **kw):
            kernel = orig(self, *a, grid=grid, warmup=warmup, **kw)
            if self.fn.__name__ == "nf4_dequant_cast_kernel" and "k" not in cap:
                cap.update(k=kernel, jit=self, args=a, kwargs=dict(kw), grid=grid)
            return kernel
        jit.JITFunction.run = grab
        _launches.set_direct(False)  # every launch through JITFunction.run, so that grab sees one
        step()
        _launches.set_direct(True)
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
    print(f"\n| step ({LAYERS} layers), paired arms | ms, median of {STEPS} |")
    print("| --- | ---: |")
    for k, v in direct_rows.items():
        print(f"| {k} | {v:.2f} |" if isinstance(v, float) else f"| {k} | {v} |")
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
                   "rows": rows, "launches": launches,
                   "direct_steps": direct_rows, "gemm_calls": gemms}, f, indent=1)


if __name__ == "__main__":
    main()
