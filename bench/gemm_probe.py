"""The host time of a run's GEMM calls, split into calls at a shape the process has not called
before and calls at a shape seen before (diagnosis only).

    python -m bench.gemm_probe [--out FILE] -m bench.run_one ARGS...

Wraps ``torch.nn.functional.linear``, ``torch.matmul``, ``torch.mm``, ``torch.Tensor.mm`` and
``torch.Tensor.matmul`` (looked up at call time by our code and by the libraries) with a timer
keyed by the call's shape (operand shapes, strides, dtypes, bias or not), runs the module after
``-m`` in this process, and writes per op: calls and host ms at new shapes and at seen shapes, and
the number of distinct shapes, to FILE (default: stdout) at exit. Why: bench_gemm_shapes.py
measured a GEMM at a never-seen row count at ~300-400 us of host time against ~20 us at a seen
one, and the packed step's row count is new at almost every step. The timer adds ~1-2 us a call.
"""
from __future__ import annotations

import json
import sys
import time

from bench import module_probe


def _key(args, kwargs):
    key = []
    for a in args:
        shape = getattr(a, "shape", None)
        key.append((tuple(shape), a.stride(), str(a.dtype)) if shape is not None else a is None)
    key.append(tuple(sorted(k for k, v in kwargs.items() if v is not None)))
    return tuple(key)


def install():
    """Wrap the GEMM entry points; returns (stats by op label, restore: a function that unwraps)."""
    import torch
    import torch.nn.functional as F

    stats: dict = {}
    seen: set = set()
    saved = []
    clock = time.perf_counter_ns

    def wrap(owner, name, label):
        orig = getattr(owner, name)
        saved.append((owner, name, orig))
        row = stats[label] = {"new_calls": 0, "new_ms": 0.0, "seen_calls": 0, "seen_ms": 0.0, "shapes": 0}

        def timed(*args, **kwargs):
            key = (label, _key(args, kwargs))
            t0 = clock()
            out = orig(*args, **kwargs)
            dt = (clock() - t0) / 1e6
            if key in seen:
                row["seen_calls"] += 1
                row["seen_ms"] += dt
            else:
                seen.add(key)
                row["shapes"] += 1
                row["new_calls"] += 1
                row["new_ms"] += dt
            return out

        setattr(owner, name, timed)

    wrap(F, "linear", "F.linear")
    wrap(torch, "matmul", "torch.matmul")
    wrap(torch, "mm", "torch.mm")
    wrap(torch.Tensor, "mm", "Tensor.mm")
    wrap(torch.Tensor, "matmul", "Tensor.matmul")

    def restore():
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)

    return stats, restore


def main() -> None:
    opts, module, rest = module_probe.parse(sys.argv[1:], "bench.gemm_probe", ("--out",))
    stats, _ = install()

    def report():
        rows = {k: dict(v, new_us_per_call=v["new_ms"] * 1e3 / max(v["new_calls"], 1),
                        seen_us_per_call=v["seen_ms"] * 1e3 / max(v["seen_calls"], 1)) for k, v in stats.items()}
        module_probe.write(opts.get("--out"), json.dumps({"module": module, "ops": rows}, indent=1))
        for k, v in rows.items():
            print(f"[gemm_probe] {k}: new shapes {v['new_calls']} calls {v['new_ms']:.1f} ms "
                  f"({v['new_us_per_call']:.0f} us each), seen {v['seen_calls']} calls {v['seen_ms']:.1f} ms "
                  f"({v['seen_us_per_call']:.1f} us each)")

    module_probe.run(module, rest, report)


if __name__ == "__main__":
    main()
