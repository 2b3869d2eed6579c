"""Which Triton kernels compile during a training run, in which step, and how long each compile
takes (diagnosis only: `bench.run_one --compile-log FILE`).

Why: the solution's first step takes ~9 s against the baseline's ~0.9 s on a fresh machine,
because Triton compiles our kernels on first use; with Triton's disk cache warm it takes ~1.6 s.
To hide or shorten that (docs/history/NOTES.md, "Next"), we need the list of what compiles. Triton
(>= 3.4: ``triton.knobs.runtime.jit_cache_hook`` / ``jit_post_compile_hook``) calls a hook before
and after every JIT compile; this records, per compile: the step it happened in (from the step
clock), the kernel, its specialization as Triton prints it, the seconds between the two hooks
(compile, or a load from Triton's disk cache), and Triton's serialized specialization data,
which ``JITFunction.preload`` can compile again later (the basis of a warm-up manifest).

The hooks only run when Triton compiles, never on a launch of a compiled kernel; they return
None, so Triton compiles as usual. Older Triton (no knobs) or the CPU interpreter (nothing
compiles): an empty log that says so.
"""
from __future__ import annotations

import json
import time
from collections import Counter


def _machine() -> dict:
    """The GPU architecture ("sm_90") and Triton version the compiles are for (a manifest key)."""
    out = {"arch": None, "triton": None}
    try:
        import torch

        if torch.cuda.is_available():
            out["arch"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - descriptive only
        pass
    return out


class CompileLog:
    def __init__(self, step_of=lambda: None):
        self.step_of = step_of  # () -> the current training step (None before training)
        self.rows: list[dict] = []
        self._started: dict[str, float] = {}
        self._previous = None
        self.available = False

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:  # Triton < 3.4: no hooks
            return False
        rt = knobs.runtime
        if not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
            return False
        self._previous = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
        self.available = True
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous
            self._previous = None

    # Triton 3.6 calls the hooks with key, repr, fn, compile, is_manual_warmup, already_compiled
    # (keywords). They take **kw and never raise: a diagnosis must not break a compile, whatever
    # another Triton version passes.
    def _before(self, **kw):
        try:
            self._started[str(kw.get("key"))] = time.perf_counter()
        except Exception:  # noqa: BLE001
            pass
        return None  # None: let Triton compile

    def _after(self, **kw):
        try:
            t0 = self._started.pop(str(kw.get("key")), None)
            fn, compile_info = kw.get("fn"), kw.get("compile") or {}
            module = getattr(fn, "module", "?")
            self.rows.append({
                "step": self.step_of(),
                "kernel": f"{getattr(module, '__name__', module)}.{getattr(fn, 'name', '?')}",
                "repr": kw.get("repr"),
                "seconds": None if t0 is None else time.perf_counter() - t0,
                "warmup": bool(kw.get("is_manual_warmup")),
                "specialization_data": compile_info.get("specialization_data") if isinstance(compile_info, dict) else None,
            })
        except Exception:  # noqa: BLE001
            pass
        return None

    def summary(self) -> dict:
        by_step = Counter(r["step"] for r in self.rows)
        secs: dict = {}
        for r in self.rows:
            secs[r["step"]] = secs.get(r["step"], 0.0) + (r["seconds"] or 0.0)
        return {"available": self.available, "compiles": len(self.rows), **_machine(),
                "by_step": {str(k): {"compiles": v, "seconds": secs[k]} for k, v in sorted(by_step.items(), key=str)},
                "by_kernel": dict(Counter(r["kernel"] for r in self.rows).most_common())}

    def write(self, path) -> None:
        from pathlib import Path

        s = self.summary()
        lines = [f"Triton JIT compiles during the run: {s['compiles']}"
                 + ("" if s["available"] else " (no compile hooks in this Triton, or nothing compiles here)"), "",
                 "| step | compiles | seconds |", "| --- | ---: | ---: |"]
        for step, v in s["by_step"].items():
            lines.append(f"| {step} | {v['compiles']} | {v['seconds']:.2f} |")
        lines += ["", "| kernel | compiles |", "| --- | ---: |"]
        lines += [f"| {k} | {n} |" for k, n in s["by_kernel"].items()]
        lines += ["", "Each compile (step, seconds, specialization):", ""]
        lines += [f"- step {r['step']}, {r['seconds'] or 0:.2f} s: `{r['repr']}`" for r in self.rows]
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
        Path(path).with_suffix(".json").write_text(json.dumps({"summary": s, "compiles": self.rows}, indent=1,
                                                              default=str), encoding="utf-8")
