"""Compile every launch configuration of every kernel for the T4 (sm_75), without a T4, and check its limits.

    python -m solution.sm75_check          # prints a table; exit 1 on any failure

Each kernel module's ``sm75_specs()`` yields dicts: name, fn (the @triton.jit function), signature ({arg:
"*fp16" | "i32" | ...}), constexprs, num_warps, optional options. Per spec: compiles for GPUTarget("cuda", 75,
32); static shared memory <= 65,536 bytes (the T4's per-block limit); PTX targets sm_75 without bf16; no bf16
pointer. Must run without TRITON_INTERPRET=1 (the interpreter replaces @triton.jit).
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import sys

from solution.env import interpreter_enabled

T4_SHARED_LIMIT = 65536


def _kernel_modules():
    import solution.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"solution.kernels.{info.name}")
        if hasattr(mod, "sm75_specs"):
            yield info.name, mod


def compile_spec(spec: dict):
    import triton
    from triton.backends.compiler import GPUTarget

    fn = spec["fn"]
    # every parameter in the kernel's order, constexprs included (Triton 3.2 and 3.3 map the
    # signature to the parameters by position)
    signature = {n: spec["signature"].get(n, "constexpr") for n in fn.arg_names}
    constexprs = spec.get("constexprs", {})
    try:  # Triton >= 3.3: constexprs keyed by the parameter's index path
        src = triton.compiler.ASTSource(fn=fn, signature=signature,
                                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    except TypeError:  # Triton 3.0 - 3.2 (what a T4 with torch <= 2.6 has): "constants", by name
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constants=constexprs)
    options = {"num_warps": spec.get("num_warps", 4), "num_stages": 1, **spec.get("options", {})}
    return triton.compile(src, target=GPUTarget("cuda", 75, 32), options=options)


def check_all() -> list[dict]:
    if interpreter_enabled():
        raise RuntimeError("run sm75_check without TRITON_INTERPRET=1")
    rows = []
    for mod_name, mod in _kernel_modules():
        for spec in mod.sm75_specs():
            row = {"module": mod_name, "name": spec["name"], "ok": True, "problems": []}
            try:
                k = compile_spec(spec)
                shared = int(k.metadata.shared)
                ptx = k.asm["ptx"]
                row["shared"] = shared
                if shared > T4_SHARED_LIMIT:
                    row["problems"].append(f"shared memory {shared} B > {T4_SHARED_LIMIT} B")
                if not re.search(r"^\.target sm_75\b", ptx, re.M):
                    row["problems"].append("PTX does not target sm_75")
                if re.search(r"\.bf16\b|bf16x2", ptx):
                    row["problems"].append("PTX uses bf16 instructions")
                if any("bf16" in str(t) for t in spec["signature"].values()):
                    row["problems"].append("bf16 pointer argument")
            except Exception as exc:  # compile error: report, keep going
                row["problems"].append(f"compile failed: {type(exc).__name__}: {exc}".splitlines()[0][:200])
                row["shared"] = None
            row["ok"] = not row["problems"]
            rows.append(row)
    return rows


def main() -> int:
    rows = check_all()
    print(f"{'kernel module':<18} {'launch config':<44} {'shared B':>9}  result")
    for r in rows:
        print(f"{r['module']:<18} {r['name']:<44} {str(r['shared']):>9}  "
              f"{'ok' if r['ok'] else 'FAIL: ' + '; '.join(r['problems'])}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} launch configurations compile for sm_75 within limits")
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
